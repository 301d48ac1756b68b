"""Training: the policy trainer and the roles around it.

- ``base``: the trainer-role contract (typed protocols, as ``flash.engine.base`` for engines);
- ``trainer`` (one process), ``trainer_group`` with ``fsdp_rank``, ``fsdp`` and ``fsdp_checkpoint``
  (an FSDP2 group of ranks), ``worker`` (the trainer as a Ray actor), ``critic`` (the value model
  for GAE);
- ``batch`` (collation of groups into tensors) and ``microbatch`` (length-grouped micro-batches);
- ``sft``: the cached supervised warm start a recipe may ask for.

A component: imported by ``flash.controllers`` and ``flash.app``; imports ``flash.weights``, the shared
``flash`` modules and the leaves (``flash.algos``, ``flash.buffers``).
"""
