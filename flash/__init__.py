"""flash: asynchronous, disaggregated RL post-training for LLMs, built around a sample buffer.

Packages, each importing only downward (``tests/unit/test_layers.py`` walks every import):

- ``flash.app``: the CLI verbs, the typed config and its checks, the runner that builds the roles,
  run state and resume, tracking, sweep, plan and plot. Imports anything below; nothing imports it.
- ``controllers`` (top-level package): the ``AsyncController`` cycle and the rollout scheduler.
- ``recipes`` (top-level package): YAML recipes and the built-in tasks they name.
- components, which the app and the controllers import and which never import them:
  ``flash.engine`` (rollout engines behind typed protocols, the engine client, the router),
  ``flash.train`` (trainer, FSDP2 group, critic, SFT warm start), ``flash.weights`` (the
  model-update group), ``flash.rewards`` (reward functions, workers, sandbox), ``flash.envs``
  (environments and their workers), and the shared modules here: ``tasks`` (the task contract),
  ``checkpoint``, ``cluster`` (Ray process helpers), ``placement``, ``models``, ``gguf``,
  ``guards``, ``cache``, ``usage``, ``errors``.
- leaves: ``buffers`` (samples, ``SampleBuffer``, its zmq service) and ``algos`` (losses,
  corrections, aggregation, estimators), which import nothing of the project.
"""
