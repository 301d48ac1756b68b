"""Content: the YAML recipes ``flash run NAME`` finds here, and ``flash.recipes.tasks``, the built-in
task generators they name (registered in ``flash.tasks`` when first looked up).

Imports components (``flash.tasks``, ``flash.envs``, ``flash.rewards``); imported only by the app.
"""
