"""The run dir a ``resume=`` names and the settings its run recorded (``config.yaml``), read as
data: one line naming what is wrong, never a parser's traceback."""

from __future__ import annotations

import io
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flash.errors import ConfigError
from flash.run_files import RunFileError, check_yaml, read_text, refuse_links


def resolve_resume(resume: str | None, recipe_name: str, runs_root: Path = Path("runs")) -> Path | None:
    """The run dir ``resume`` names (``latest``: newest ``runs/<recipe>-*`` with a config)."""
    if not resume:
        return None
    if resume == "latest":
        runs = sorted(
            (p for p in runs_root.glob(f"{recipe_name}-*") if (p / "config.yaml").is_file()),
            key=lambda p: (p / "config.yaml").stat().st_mtime,
        )
        if not runs:
            raise ConfigError(
                f"resume=latest: no run of recipe '{recipe_name}' under {runs_root}/; pass resume=RUN_DIR"
            )
        refuse_links(runs[-1], "resume=latest: the run dir")
        return runs[-1]
    path = Path(resume)
    refuse_links(path, f"resume={resume}: the run dir")
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"resume={resume}: not a run dir (no config.yaml there); pass the dir a run "
            f"printed as 'flash: run dir ...', or resume=latest"
        )
    return path


def saved_config(run_dir: Path) -> dict:
    """The run's ``config.yaml`` as a mapping; a file flash did not write (too large, nested too
    deep, holding an alias, binary, not YAML, not a mapping: ``flash.run_files``' bounds) is one
    line naming it, not a parser's traceback."""
    path = run_dir / "config.yaml"
    try:
        text = read_text(path)  # within DOC_BOUNDS' size; no link followed
        check_yaml(text, str(path))  # its nesting, and no alias, before it is built
        saved = OmegaConf.to_container(OmegaConf.load(io.StringIO(text)))
    except RunFileError as exc:
        raise ConfigError(
            f"resume={run_dir}: {exc}; pass a run dir that flash wrote, or start a new run without resume"
        ) from None
    except (yaml.YAMLError, OmegaConfBaseException, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"resume={run_dir}: cannot read {path} ({str(exc).splitlines()[0][:200]}); pass a run "
            f"dir that flash wrote, or start a new run without resume"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"resume={run_dir}: {path} is not a run's config (a mapping of settings); pass a run "
            f"dir that flash wrote, or start a new run without resume"
        )
    return saved
