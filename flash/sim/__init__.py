"""Simulated GPU roles: the time a rollout engine and a trainer would take on a GPU cluster.

- ``cost``: pure cost models (decode step, prefill, train step, weight sync) and named presets for
  7B- and 32B-class models on H100s, each number beside its source;
- ``workload``: seeded long-tailed response lengths and synthetic tokens;
- ``config``: the ``sim:`` section of a recipe;
- ``accounting``: a step's simulated seconds (GPU time scaled back, the driver's real time not).

The simulated engine (``flash.engine.sim_engine``) and trainer (``flash.train.sim_trainer``) sleep
``simulated seconds × sim.time_scale`` of real time (their own CPU work included), so the
production controller, scheduler and buffer run unchanged against them. A component leaf: imports nothing of the project.
"""
