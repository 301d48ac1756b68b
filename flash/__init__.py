"""flash: asynchronous, disaggregated RL post-training for LLMs, built around a sample buffer.

Packages, each importing only downward (``tests/unit/test_layers.py`` walks every import):

- ``flash.app``: the CLI verbs, the typed config and its checks, the runner that builds the roles,
  run state and resume, tracking, sweep, plan and plot. Imports anything below; nothing imports it.
- ``flash.controllers``: the ``AsyncController`` cycle and the rollout scheduler.
- ``flash.recipes``: YAML recipes and the built-in tasks they name.
- components, which the app and the controllers import and which never import them:
  ``flash.engine`` (rollout engines behind typed protocols, the engine client, the router),
  ``flash.train`` (trainer, FSDP2 group, critic, SFT warm start), ``flash.weights`` (the
  model-update group), ``flash.rewards`` (reward functions, workers, sandbox), ``flash.envs``
  (environments and their workers), and the shared modules here: ``tasks`` (the task contract),
  ``checkpoint``, ``cluster`` (Ray process helpers), ``placement``, ``models``, ``gguf``,
  ``guards``, ``cache``, ``usage``, ``errors``.
- leaves: ``flash.buffers`` (samples, ``SampleBuffer``, its zmq service) and ``flash.algos`` (losses,
  corrections, aggregation, estimators), which import nothing of the project.

``flash.algos``, ``flash.buffers``, ``flash.controllers`` and ``flash.recipes`` are the folders
``algos/``, ``buffers/``, ``controllers/`` and ``recipes/`` at the repository's top level, reached
through the links of the same names in ``flash/`` (``flash/algos -> ../algos``): a source tree, an
editable install and a wheel (which holds the files) all import them as ``flash.X``, and static
tools (mypy) see the same names. Nothing of flash installs or imports under another top-level name.
"""
