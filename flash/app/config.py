"""Typed, strict configuration: OmegaConf structured configs, YAML recipes, ``key=value`` overrides.

Strictness is the point (DESIGN.md invariant 6): ROLL's users lose hours to keys that are silently
ignored. Here every key a user writes is checked against the schema *before* merging, and an
unknown key is an error that names the closest valid key. Sections whose keys depend on a plugin
(the loss, the advantage estimator, the task) are free-form dicts in the schema and are checked
against the plugin's own knobs by its registry.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flash.app.keys import check_keys
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
    """Recipe YAML + ``key=value`` overrides → a validated FlashConfig object."""
    try:
        recipe = OmegaConf.load(str(recipe_path))
        cli = OmegaConf.from_dotlist(_check_dotlist(list(overrides)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse {recipe_path}: {str(exc).splitlines()[0]}") from None
    for source in (recipe, cli):
        check_keys(OmegaConf.to_container(source), FlashConfig)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FlashConfig), recipe, cli)
        cfg: FlashConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}': {msg}" if key else msg) from None
    except ValueError as exc:  # a section's own __post_init__ check
        raise ConfigError(f"invalid config: {exc}") from None
    imply_trainer_workers(cfg)
    validate(cfg)
    return cfg


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


def _check_dotlist(items: list[str]) -> list[str]:
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value")
    return items


def to_yaml(cfg: FlashConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: FlashConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
