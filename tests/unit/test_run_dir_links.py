"""A run dir never sends a write elsewhere (flash.run_files): a run, resume or sweep dir that is or
holds a link is refused in one line before anything is written or truncated, and every file flash
writes there (logs, config, summary, events, eval generations, checkpoints, plots, sweep results)
is opened without following a link. The file a link points at is left as it was."""

import json
import os
from types import SimpleNamespace

import pytest

from flash.app.evaluation import EvalSet, evaluate_sets
from flash.app.plot import RunData, plot_runs
from flash.app.resume import append_event, held_run, make_run_dir, resolve_resume, restore_logs
from flash.app.roles import RunFiles
from flash.app.sweep import Point, prepare, write_results
from flash.checkpoint import write_json
from flash.run_files import RunDirError, open_run_file, refuse_links, run_subdir, write_run_text
from flash.tasks import TaskItem

KEEP = "the user's own file\n"


@pytest.fixture
def outside(tmp_path):
    """A file outside every run dir, and a path that does not exist (a dangling link's target)."""
    (tmp_path / "outside").mkdir()
    victim = tmp_path / "outside" / "notes.txt"
    victim.write_text(KEEP)
    return victim, tmp_path / "outside" / "made-by-flash"


def untouched(victim, missing):
    return victim.read_text() == KEEP and not os.path.lexists(missing)


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and "Traceback" not in text and len(text) < 600
    return text


PLANTS = {  # where a link is planted in a run dir, and what it points at
    "dangling metrics.jsonl": ("metrics.jsonl", "missing"),
    "ledger.jsonl to a file outside": ("ledger.jsonl", "victim"),
    "eval file to a file outside": ("eval/dev/step-0.jsonl", "victim"),
    "tb dir to a folder outside": ("tb", "folder"),
    "checkpoint file to a file outside": ("checkpoints/ckpt-2/state.json", "victim"),
}


def plant(run_dir, where, to, victim, missing):
    path = run_dir / where
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink({"victim": victim, "missing": missing, "folder": victim.parent}[to], path)
    return path


@pytest.mark.parametrize("plant_at", PLANTS)
def test_a_run_dir_holding_a_link_anywhere_is_refused_in_one_line(tmp_path, outside, plant_at):
    victim, missing = outside
    run_dir = tmp_path / "run"
    link = plant(run_dir, *PLANTS[plant_at], victim, missing)
    cfg = SimpleNamespace(run_dir=str(run_dir), overwrite=False)
    with pytest.raises(RunDirError) as err:
        make_run_dir(cfg, "stutter")
    assert one_line(err).startswith(f"run_dir {run_dir} holds {link}, a symbolic link to ")
    assert "remove it, or pick another run_dir" in str(err.value)
    cfg.overwrite = True  # a run moved aside is refused the same
    with pytest.raises(RunDirError):
        make_run_dir(cfg, "stutter")
    assert untouched(victim, missing) and link.is_symlink() and sorted(os.listdir(tmp_path)) == ["outside", "run"]


def test_a_run_dir_that_is_a_link_or_holds_a_fifo_or_a_hard_link_is_refused(tmp_path, outside):
    victim, missing = outside
    os.symlink(victim.parent, tmp_path / "linked")
    with pytest.raises(RunDirError, match="linked is a symbolic link to"):
        refuse_links(tmp_path / "linked")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "events.jsonl")
    with pytest.raises(RunDirError, match="events.jsonl, not a regular file"):
        refuse_links(tmp_path / "fifo")
    (tmp_path / "hard").mkdir()
    os.link(victim, tmp_path / "hard" / "config.yaml")
    with pytest.raises(RunDirError, match="config.yaml, a file with 2 hard links"):
        refuse_links(tmp_path / "hard")
    assert held_run(tmp_path / "fifo") == ["events.jsonl"]
    os.symlink(missing, tmp_path / "hard" / "metrics.jsonl")
    assert held_run(tmp_path / "hard") == ["config.yaml", "metrics.jsonl"]  # a dangling link counts
    assert untouched(victim, missing)


def test_a_resume_into_a_linked_run_dir_is_refused_and_truncates_nothing(tmp_path, outside):
    victim, missing = outside
    run_dir = tmp_path / "stutter-1"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 0\n")
    os.symlink(victim, run_dir / "metrics.jsonl")
    for resume, root in ((str(run_dir), tmp_path), ("latest", tmp_path)):
        with pytest.raises(RunDirError) as err:
            resolve_resume(resume, "stutter", runs_root=root)
        assert f"holds {run_dir / 'metrics.jsonl'}, a symbolic link to {str(victim)!r}" in one_line(err)
    with pytest.raises(RunDirError):
        restore_logs(run_dir, {"metrics": 3})  # the cut itself refuses the link too
    os.symlink(missing, run_dir / "events.jsonl")
    with pytest.raises(RunDirError, match="events.jsonl is a symbolic link"):
        append_event(run_dir, "resume")
    assert untouched(victim, missing)


@pytest.mark.parametrize("append", [False, True])
def test_the_run_logs_config_and_checkpoint_files_open_no_link(tmp_path, outside, append):
    victim, missing = outside
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(missing, run_dir / "schedule.jsonl")
    with pytest.raises(RunDirError, match="schedule.jsonl is a symbolic link"):
        RunFiles.open(run_dir, append=append)
    for name in ("config.yaml", "summary.json", "state.json"):
        os.symlink(victim, run_dir / name)
        with pytest.raises(RunDirError, match=f"{name} is a symbolic link"):
            (write_json(run_dir / name, {}) if name == "state.json" else write_run_text(run_dir / name, "x"))
    os.symlink(victim.parent, run_dir / "checkpoints")
    with pytest.raises(RunDirError, match="checkpoints is a symbolic link"):
        run_subdir(run_dir, "checkpoints")
    with pytest.raises(RunDirError, match="plain name"):
        run_subdir(run_dir, "eval", "../../outside")
    assert untouched(victim, missing)
    (run_dir / "schedule.jsonl").unlink()
    files = RunFiles.open(run_dir, append=append)  # the control: plain files open, written and cut
    files.metrics.write("{}\n")
    files.close()
    assert (run_dir / "metrics.jsonl").read_text() == "{}\n"
    with open_run_file(run_dir / "metrics.jsonl", "w") as f:
        f.write("a")
    assert (run_dir / "metrics.jsonl").read_text() == "a"


def test_an_eval_generations_file_linked_out_is_not_overwritten(tmp_path, outside):
    victim, missing = outside
    run_dir = tmp_path / "run"
    plant(run_dir, "eval/dev/step-4.jsonl", "victim", victim, missing)
    sample = SimpleNamespace(response_ids=[1, 2], prompt_ids=[3], reward=1.0, finish_reason="stop")
    scheduler = SimpleNamespace(evaluate_samples=lambda items, params, tag, seed, **_: [sample] * len(items))
    sets = [EvalSet("dev", [TaskItem(0, "q", "a")], None)]
    with pytest.raises(RunDirError, match="step-4.jsonl is a symbolic link"):
        evaluate_sets(scheduler, sets, None, 2, 0, run_dir, 4, decode=lambda ids: "x", decode_prompt=str)
    assert untouched(victim, missing)
    metrics = evaluate_sets(scheduler, sets, None, 2, 0, run_dir, 5, decode=lambda ids: "x", decode_prompt=str)
    assert metrics["eval/dev/mean@2"] == 1.0
    assert [json.loads(x)["sample"] for x in (run_dir / "eval/dev/step-5.jsonl").read_text().splitlines()] == [0, 1]


def test_plot_and_sweep_outputs_are_not_written_through_a_link(tmp_path, outside):
    victim, missing = outside
    os.symlink(victim, tmp_path / "plot.png")
    run = RunData(dir=tmp_path, label="r", metrics=[{"step": 1, "reward/mean": 0.5}])
    with pytest.raises(RunDirError, match="plot.png is a symbolic link"):
        plot_runs([run], tmp_path / "plot.png")
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    os.symlink(missing, sweep_dir / "results.md")
    with pytest.raises(RunDirError, match="results.md is a symbolic link"):
        write_results([Point({"seed": "0"}, ["seed=0"], "seed-0")], [], sweep_dir, "# sweep", "")
    with pytest.raises(RunDirError, match=f"sweep dir {sweep_dir} holds"):
        prepare(tmp_path / "recipe.yaml", [Point({"seed": "0"}, ["seed=0"], "seed-0")], sweep_dir)
    assert untouched(victim, missing)


def test_a_start_that_failed_before_its_first_step_does_not_block_its_run_dir(tmp_path):
    from flash.app.config import load_config
    from flash.errors import FlashError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append_event(run_dir, "start")  # what a start that failed at its roles leaves: events, run.json,
    (run_dir / "run.json").write_text("{}")  # the config and the logs it opened, still empty
    (run_dir / "config.yaml").write_text("seed: 0\n")
    for name in ("ledger", "metrics", "timeline", "eval", "schedule", "samples"):
        (run_dir / f"{name}.jsonl").write_text("")
    cfg = load_config("recipes/stutter.yaml", [f"run_dir={run_dir}"])
    assert make_run_dir(cfg, "stutter") == run_dir and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (run_dir / "events.jsonl").read_text().count('"start"') == 1  # its events are kept
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # a run that trained a step holds the dir
    with pytest.raises(FlashError, match=r"already holds a run \(config.yaml, run.json, ledger.jsonl"):
        make_run_dir(cfg, "stutter")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "checkpoints" / "ckpt-1").mkdir(parents=True)  # so does one with a checkpoint
    with pytest.raises(FlashError, match="already holds a run"):
        make_run_dir(cfg, "stutter")
