"""Rollout engines behind one typed contract.

- ``base``: request and output types, and the engine protocols (``Rollout``, ``Control``, ``Ops``,
  ``Lifecycle``, ``UpdateTarget``; each at most 5 methods) every engine satisfies;
- ``client``: ``EngineClient``, through which every engine call of a run goes (restarts a dead or
  hung engine and asks the scheduler to requeue what it lost; a pass-through with no restarts);
- ``torch_engine`` (with ``kv_cache`` and ``loop``) and ``torch_worker``: the embedded torch
  engine and its Ray actor; ``vllm_engine`` (with ``vllm_parts``, ``vllm_updates`` and
  ``vllm_weights``): vLLM's engine behind the same methods; ``router``: several replicas behind one
  engine's methods.

A component: imported by ``flash.controllers`` and ``flash.app``; imports ``flash.weights``, the shared
``flash`` modules and the leaves.
"""
