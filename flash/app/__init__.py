"""The application layer: what a user runs.

- ``cli``: the ``flash`` verbs (``run``, ``ls``, ``validate``, ``sweep``, ``plan``, ``plot``, ...);
  ``recipe_files`` resolves a recipe by name or path.
- ``config`` (the typed schema), ``keys`` (strict keys, closest-name errors), ``config_checks``
  and ``component_checks`` (value checks that name the fix).
- ``runner``: builds the roles of a run (engines, trainer, buffer, scheduler, controller) and runs
  it; ``run_state`` and ``resume`` save and restore a run; ``tracking`` writes metrics.
- ``sweep``, ``plan`` with ``plan_model``, ``plot``: grids of runs, cost-model predictions, figures.

May import every other package of the project; nothing in the project imports it.
"""
