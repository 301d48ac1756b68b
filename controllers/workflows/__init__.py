"""Workflows: how one admitted unit becomes a scored sample, behind one small protocol.

- ``base``: ``Unit``, the ``Workflow`` protocol (launch / cancel / route / finish / requeue) and
  ``Service`` (metrics, stop); unit ids and seeds;
- ``single_turn``: one engine request per unit, scored by the reward;
- ``episode`` (with ``env_faults``): one environment episode per unit on the ``EnvWorker`` actors.

Imported by the scheduler core (``flash.controllers.scheduler``) and its builders; imports components
(``flash.engine``, ``flash.envs``) and leaves only, never the core.
"""
