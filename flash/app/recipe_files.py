"""Recipes by name: the YAML files shipped in ``recipes/``, or a path to the user's own file.

The CLI (``flash run``, ``flash ls``) and ``flash sweep`` both resolve a recipe this way.
"""

from __future__ import annotations

from pathlib import Path

from flash import recipes as _recipes_pkg
from flash.errors import RecipeNotFound

RECIPES_DIR = Path(_recipes_pkg.__file__).resolve().parent


def recipe_paths() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def resolve_recipe(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or "/" in name:
        if path.is_file():
            return path
        raise RecipeNotFound(f"recipe file '{name}' does not exist")
    known = recipe_paths()
    if name in known:
        return known[name]
    from flash.app.keys import closest

    raise RecipeNotFound(
        f"no recipe named '{name}'{closest(name, list(known))}; "
        f"known recipes: {', '.join(known) or 'none'} (see `flash ls`)"
    )
