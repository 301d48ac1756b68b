"""A resumed run keeps the settings it started with (``resume=DIR`` reads ``DIR/config.yaml``), and
a stopped run names its cause and the command that resumes it."""

from flash.app.cli import main
from flash.app.config import load_config, to_yaml
from flash.app.recipe_files import resolve_recipe
from flash.app.runner import interrupted
from flash.errors import Terminated


def _run_dir(tmp_path, overrides):
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    cfg = load_config(resolve_recipe("stutter"), overrides)
    cfg.run_dir = str(run_dir)  # what a run records: its dir
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def test_an_interrupt_names_its_cause_and_the_resume_command():
    assert interrupted(KeyboardInterrupt(), "stutter", "runs/a") == (
        "ctrl-C; resume from the last checkpoint: flash run stutter resume=runs/a"
    )
    assert interrupted(Terminated("SIGTERM"), "", "runs/a") == (
        "SIGTERM; resume from the last checkpoint: flash run resume=runs/a"
    )


def test_resume_keeps_the_overrides_the_run_started_with(tmp_path):
    default = load_config(resolve_recipe("stutter"))
    assert (default.checkpoint.every_steps, default.seed, default.train.steps) != (2, 3, 7)
    run_dir = _run_dir(tmp_path, ["checkpoint.every_steps=2", "seed=3", "train.steps=7"])
    cfg = load_config(resolve_recipe("stutter"), [f"resume={run_dir}", "train.steps=9"])
    assert (cfg.checkpoint.every_steps, cfg.seed, cfg.train.steps) == (2, 3, 9)  # the new steps on top
    assert cfg.resume == str(run_dir) and cfg.run_dir is None  # the run dir follows resume


def test_resume_alone_is_the_run_dir_s_own_recipe(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, ["seed=3"])
    assert main(["validate", f"resume={run_dir}"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {run_dir}/config.yaml")
    assert main(["validate", f"resume={run_dir}", "seed=4"]) == 2
    assert "settings differ from the checkpointed run (seed: 3 -> 4)" in capsys.readouterr().err
    assert main(["validate", "seed=4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "flash: error: 'seed=4' is not a recipe: name one first (`flash ls`), e.g. flash validate stutter "
        "seed=4; only resume=RUN_DIR may stand alone"
    )
