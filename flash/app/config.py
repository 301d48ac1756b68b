"""Typed, strict configuration: OmegaConf structured configs, YAML recipes, ``key=value`` overrides.

Strictness is the point (docs/design.md invariant 6): ROLL's users lose hours to keys that are silently
ignored. Here every key a user writes is checked against the schema *before* merging, and an
unknown key is an error that names the closest valid key. Sections whose keys depend on a plugin
(the loss, the advantage estimator, the task) are free-form dicts in the schema and are checked
against the plugin's own knobs by its registry.
"""

from __future__ import annotations

import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flash.app.interpolation import check_file, resolve, split_allow_env
from flash.app.keys import check_keys
from flash.app.merge import merge_layers, value_at
from flash.app.schema import (  # noqa: F401 -- the schema is read through this module too
    AlgoConfig,
    CheckpointConfig,
    CriticConfig,
    DataConfig,
    EvalConfig,
    FlashConfig,
    ModelConfig,
    ModelUpdateConfig,
    RayConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    TrackingConfig,
    TrainConfig,
)
from flash.errors import ConfigError


def load_config(recipe_path: str | Path, overrides: list[str] = ()) -> FlashConfig:
    """Recipe YAML + ``key=value`` overrides → a validated FlashConfig object. ``allow_env=[VAR,...]``
    among the overrides names the environment variables the files may read (flash.app.interpolation)."""
    allow_env, overrides = split_allow_env(list(overrides))
    cli = _parse_overrides(_check_dotlist(overrides))
    chain = resumed_run(cli.get("resume"), Path(recipe_path), allow_env) or recipe_chain(Path(recipe_path), allow_env)
    for source in (*chain, cli):
        check_keys(OmegaConf.to_container(source), FlashConfig)
    empty = [o for o in overrides if o.partition("=")[2].strip() == "{}"]  # `key={}` empties, then the rest
    rest = [o for o in overrides if o not in empty]
    merged_layers = merge_layers(
        [
            OmegaConf.to_container(OmegaConf.structured(FlashConfig)),
            *(OmegaConf.to_container(c) for c in chain),
            *(OmegaConf.to_container(_parse_overrides(o)) for o in (empty, rest) if o),
        ]
    )
    for note in merged_layers.notes:
        print(f"flash: note: {note}", file=sys.stderr)
    settings = resolve(merged_layers.settings)  # every interpolation, bounded: none is left to OmegaConf
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FlashConfig), settings)
        for key in merged_layers.whole:  # emptied or a new choice: not merged into the schema's defaults
            node = OmegaConf.select(merged, key)
            if not (isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node))):  # a schema section
                OmegaConf.update(merged, key, value_at(settings, key), merge=False)
        cfg: FlashConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}': {msg}" if key else msg) from None
    except ValueError as exc:  # a section's own __post_init__ check
        raise ConfigError(f"invalid config: {exc}") from None
    imply_trainer_workers(cfg)
    resolve_plugins(cfg, Path(recipe_path).resolve().parent)
    validate(cfg)
    return cfg


PER_START = ("resume", "run_dir", "overwrite", "trust_checkpoint")  # what one start says, not the run


def resumed_run(resume, recipe_path: Path, allow_env: tuple[str, ...] = ()) -> list:
    """``resume=DIR``: the settings the run recorded in ``DIR/config.yaml`` (less ``PER_START``) in
    place of the recipe's, so a resumed run keeps every override it started with; the overrides
    given now apply on top (what may change on resume: ``flash.app.resume.MAY_CHANGE``). Empty
    when there is no such run (the pre-start checks name it). The file is checked as a recipe
    file is (``flash.app.interpolation.check_file``)."""
    from flash.app.resume_dir import resolve_resume, saved_config

    if not resume:
        return []
    try:
        run_dir = resolve_resume(str(resume), recipe_path.stem)
    except ConfigError:
        return []
    saved = {k: v for k, v in saved_config(run_dir).items() if k not in PER_START}
    check_file(saved, str(run_dir / "config.yaml"), allow_env)
    return [migrate(OmegaConf.create(saved), run_dir / "config.yaml")]


def resolve_plugins(cfg: FlashConfig, recipe_dir: Path) -> None:
    """Plugins are found beside the recipe: a ``.py`` path is taken relative to the recipe's
    folder, a module name that is a file there becomes that file's path, and the folder is
    importable (for ``module:function`` rewards and ``task.env`` modules too; Ray's workers inherit
    the search path); a verifiers ``task.env`` ``.py`` path is taken relative to the folder."""
    import sys

    from flash.app.recipe_files import RECIPES_DIR

    if recipe_dir != RECIPES_DIR.resolve() and str(recipe_dir) not in sys.path:
        sys.path.append(str(recipe_dir))
    out = []
    for name in cfg.plugins:
        if name.endswith(".py"):
            path = Path(name).expanduser()
            path = path if path.is_absolute() else recipe_dir / path
            if not path.is_file():
                raise ConfigError(f"plugins: no such file {path} (a .py path is relative to the recipe's folder)")
            name = str(path)
        elif (recipe_dir / f"{name}.py").is_file():
            name = str(recipe_dir / f"{name}.py")
        out.append(name)
    cfg.plugins = out
    env = cfg.task.get("env") if cfg.task.get("name") == "verifiers" else None
    if isinstance(env, str) and env.endswith(".py") and not Path(env).expanduser().is_absolute():
        cfg.task["env"] = str(recipe_dir / env)  # task.env: a .py path beside the recipe


MAX_RECIPE_BYTES = 1 << 20


def read_recipe(path: str | Path, allow_env: tuple[str, ...] = ()):
    """A recipe file as an OmegaConf mapping; every way it can be unreadable is one line naming
    the file (and the line, for YAML errors), never its text. YAML is data here: OmegaConf's loader
    is a safe loader, so a ``!!python/...`` tag is an error, never a constructor; a file over
    ``MAX_RECIPE_BYTES`` is no recipe; its interpolations are checked (``check_file``: the
    resolvers a file may use, the variables ``allow_env`` allows) and bounded."""
    size = Path(path).stat().st_size if Path(path).is_file() else 0
    if size > MAX_RECIPE_BYTES:
        raise ConfigError(f"{path}: {size} bytes, more than a recipe holds ({MAX_RECIPE_BYTES})")
    try:
        recipe = OmegaConf.load(str(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"cannot parse {path}{where}: {problem}") from None
    except (OmegaConfBaseException, OSError, UnicodeDecodeError, RecursionError) as exc:
        why = (
            "not UTF-8 text"
            if isinstance(exc, UnicodeDecodeError)
            else "its values or interpolations nest too deep"
            if isinstance(exc, RecursionError)
            else exc.strerror
            if isinstance(exc, OSError) and exc.strerror
            else type(exc).__name__
        )
        raise ConfigError(f"cannot read {path}: {why}") from None
    if not isinstance(recipe, DictConfig):
        kind = "a list" if isinstance(recipe, ListConfig) else type(recipe).__name__
        raise ConfigError(f"{path}: a recipe is a mapping of sections (task:, rollout:, train:, ...), not {kind}")
    if not recipe:
        raise ConfigError(
            f"{path} is empty: a recipe names at least its task (task: {{name: ...}}); "
            f"`flash ls` lists recipes to start from"
        )
    layer = OmegaConf.to_container(recipe)
    check_file(layer, str(path), allow_env)
    try:
        resolve(layer, missing_ok=True)  # bounded alone too: the defaults only complete its references
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return migrate(recipe, path)


# train.mixed_precision (fp32 | bf16, the FSDP2 group's) became model.dtype, one setting for every role
OLD_PRECISION = {"fp32": "float32", "bf16": "bfloat16"}


def migrate(recipe: DictConfig, path: str | Path) -> DictConfig:
    """A recipe or a run's config.yaml written with a key that has a new name, in the new name (the
    same meaning, so runs recorded before resume and replay); a value the new key cannot hold, or a
    clash with the new key, is one line naming both."""
    train = recipe.get("train")
    if not isinstance(train, DictConfig) or "mixed_precision" not in train:
        return recipe
    old = train.pop("mixed_precision")
    if old not in OLD_PRECISION:
        raise ConfigError(f"{path}: train.mixed_precision={old!r} is now model.dtype (float32 | bfloat16 | float16)")
    if not isinstance(recipe.get("model"), DictConfig):
        recipe["model"] = {}
    model = recipe["model"]
    if model.get("dtype", OLD_PRECISION[old]) != OLD_PRECISION[old]:
        raise ConfigError(
            f"{path}: train.mixed_precision={old} and model.dtype={model.get('dtype')} disagree; set model.dtype alone"
        )
    if old != "fp32":
        model["dtype"] = OLD_PRECISION[old]
    return recipe


MAX_BASES = 8


def recipe_chain(path: Path, allow_env: tuple[str, ...] = ()) -> list:
    """The recipe and the recipes it builds on, base first: ``base: NAME`` (a name from `flash ls`,
    or a ``.yaml``/``.yml`` path relative to this recipe's file) starts a recipe from another one
    instead of from the defaults; its own keys then override the base's. Chains are at most
    ``MAX_BASES`` deep and never circular (one line naming the files). A base is a recipe file or
    nothing (``base_path``, ``check_base``): an error about it names the file, never its text."""
    chain, seen = [], []
    while True:
        recipe = read_recipe(path, allow_env)
        if seen:
            check_base(recipe, path)
        seen.append(path.resolve())
        base = recipe.pop("base", None)
        chain.insert(0, recipe)
        if base is None:
            return chain
        path = base_path(path, base)
        if path.resolve() in seen or len(seen) > MAX_BASES:
            raise ConfigError(
                f"recipe bases go round or deeper than {MAX_BASES}: "
                f"{' -> '.join(str(p) for p in [*seen, path.resolve()])}"
            )


RECIPE_SUFFIXES = (".yaml", ".yml")


def base_path(recipe: Path, base) -> Path:
    """The file ``base: NAME`` in ``recipe`` names: a ``.yaml``/``.yml`` file (beside the recipe, or
    as given), or a recipe from `flash ls`; anything else is one line."""
    from flash.app.recipe_files import resolve_recipe

    if not isinstance(base, str) or not base:
        raise ConfigError(f"{recipe}: base must be a recipe name or a file path, got {base!r}")
    if Path(base).suffix in RECIPE_SUFFIXES:
        near = recipe.parent / Path(base).expanduser()
        return near if near.is_file() else resolve_recipe(base)
    if "/" in base or "\\" in base or Path(base).suffix:
        raise ConfigError(
            f"{recipe}: base: {base!r} is neither a recipe's name (`flash ls`) nor a "
            f"{'/'.join(RECIPE_SUFFIXES)} recipe file"
        )
    return resolve_recipe(base)


def check_base(recipe: DictConfig, path: Path) -> None:
    """A base is a recipe: its top-level keys are flash's sections (a file of other keys is named,
    its keys are not)."""
    known = {f.name for f in fields(FlashConfig)} | {"base"}
    if not all(isinstance(k, str) and k in known for k in recipe):
        raise ConfigError(
            f"base: {path} is not a recipe (its top-level keys are not flash's sections: task, rollout, train, ...)"
        )


def validate(cfg: FlashConfig) -> None:
    """Value checks and plugin-knob checks (``flash.app.config_checks``); everything `flash validate`
    promises short of running."""
    from flash.app.config_checks import validate as check

    check(cfg)


def imply_trainer_workers(cfg: FlashConfig) -> None:
    """``train.workers`` and ``placement.roles.actor_train.num_workers`` are one number: the FSDP2
    group runs one rank per actor_train worker. Set either alone and the other follows it; set both
    to different counts and ``validate`` names the conflict."""
    role = cfg.placement.roles.actor_train
    if cfg.train.workers > 1 and role.num_workers == 1:
        role.num_workers = cfg.train.workers
    elif role.num_workers > 1 and cfg.train.workers == 1:
        cfg.train.workers = role.num_workers


def emptied(items) -> list[str]:
    """The keys that ``key={}`` overrides empty (e.g. ``reward.fn={}``: the task's own reward); the
    other overrides apply after, so ``reward.fn={} reward.fn.name=code`` is ``{name: code}``."""
    return [k.strip() for k, _, v in (item.partition("=") for item in items) if v.strip() == "{}"]


def _parse_overrides(items: list[str]):
    """The ``key=value`` overrides as one OmegaConf mapping; when they do not parse, the error
    names the override that does not (each is tried alone only then)."""
    bad = (OmegaConfBaseException, yaml.YAMLError)
    try:
        return OmegaConf.from_dotlist(items)
    except bad as whole:
        for item in items:
            try:
                OmegaConf.from_dotlist([item])
            except bad as exc:
                problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ConfigError(f"cannot parse override '{item}': {problem}") from None
        raise ConfigError(f"cannot parse the overrides together: {str(whole).splitlines()[0]}") from None


def _check_dotlist(items: list[str]) -> list[str]:
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value")
    return items


def to_yaml(cfg: FlashConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def base_differences(recipe_path: str | Path, cfg: FlashConfig, overrides: list[str] = ()) -> list[str]:
    """``key: base value -> value`` for every setting of ``cfg`` that differs from its recipe's
    base (the chain without the recipe itself); empty for a recipe without ``base:``. ``overrides``:
    the command line's, for the variables it allows the files to read."""
    chain = recipe_chain(Path(recipe_path), split_allow_env(list(overrides))[0])
    if len(chain) < 2:
        return []
    base = flat_settings(
        merge_layers(
            [
                OmegaConf.to_container(OmegaConf.structured(FlashConfig)),
                *(OmegaConf.to_container(c) for c in chain[:-1]),
            ]
        ).settings
    )
    mine = flat_settings(to_dict(cfg))
    return [
        f"{k}: {base.get(k, '(unset)')!r} -> {mine.get(k, '(unset)')!r}"
        for k in sorted(set(base) | set(mine))
        if base.get(k, "(unset)") != mine.get(k, "(unset)")
    ]


def flat_settings(d: dict, prefix: str = "") -> dict:
    """``{'section.key': value}`` of a nested mapping. An empty mapping holds no settings, so a mapping
    left empty and one that is absent read the same (``eval.sets`` at its default is no difference)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_settings(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_dict(cfg: FlashConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
