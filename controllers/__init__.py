"""Control: the asynchronous training cycle and the rollout scheduler it drives.

- ``async_controller``: ``AsyncController``, the suspend → weight update → resume cycle around
  ``get_batch`` (staleness rule), proximal logprobs, advantages and the train step;
- ``scheduler``: ``RolloutCore``, the one scheduler core, composed of ``admission``, ``inflight``
  and ``lifecycle.Outcomes`` -- admission under the staleness bound (``staleness``,
  ``provisioning``: spares), threads, versions, redundancy, filters (``filters``), the per-sample
  ``lifecycle`` and ledger, checkpoint state (``core_state``), requeue after engine faults,
  evaluation (``evaluation``) -- for every workflow (``workflows``: single-turn, episode);
  ``RolloutScheduler`` is the core running single-turn requests;
- ``tail_batching`` (rules in ``tail_policy``): RollPacker's tail batching as a round and
  admission policy on the core; ``episode_runtime``: the core running environment episodes;

Imported by the app (``flash.app``); imports components (engine, train, weights, rewards, envs,
tasks) and leaves (``flash.buffers``, ``flash.algos``), never ``flash.app``.
"""
