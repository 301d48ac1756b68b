"""A run file read back is bounded before it is parsed (flash.run_files): its size by ``fstat``
(a sparse multi-GB file is refused before a byte is read), one line's length by a limited read, and
its JSON nesting counted on the bytes (a deep line never reaches the recursive parser). Every
reader of a run dir -- ``flash plot``, ``flash replay``'s schedule, ``flash sweep``'s point
markers, ``flash plan``'s traces (gzipped too), resume's config and checkpoint state, a
checkpoint's manifest -- refuses in one line naming the file, the line and the limit."""

import gzip
import json
import os
from pathlib import Path

import pytest

from flash.app.cli import main
from flash.app.plan import _jsonl as plan_jsonl
from flash.app.plot import load_run
from flash.app.resume import load_state
from flash.app.resume_dir import saved_config
from flash.app.schedule import count_steps
from flash.app.sweep import Point, prepare
from flash.checkpoint_trust import read_manifest
from flash.errors import FlashError
from flash.run_files import LOG_BOUNDS, RunFileError, nesting_depth

DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError on it


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and "Traceback" not in text and len(text) < 600
    return text


def sparse(path, size: int) -> None:
    """A file of ``size`` zero bytes that takes no disk (and no newline: one huge line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize(
    "text, depth",
    [
        (b"{}", 1),
        (b"[[]]", 2),
        (b"1", 0),
        (b'"[[["', 0),
        (b'{"a": [1, {"b": "[[[{"}]}', 3),
        (b'["\\\\", [[]]]', 3),
        (b'["a\\\\\\"[", {}]', 2),
        (b'{"k\\"]]": [[[0]]]}', 4),
        (DEEP, 100_000),
    ],
)
def test_the_nesting_is_counted_on_the_bytes_brackets_in_strings_and_escapes_left_out(text, depth):
    if len(text) < 100:
        json.loads(text)  # each case is JSON
    assert nesting_depth(text) == depth


def test_plot_refuses_a_sparse_multi_gb_metrics_file_before_reading_it(tmp_path):
    sparse(tmp_path / "run" / "metrics.jsonl", 4 << 30)
    with pytest.raises(RunFileError) as err:
        load_run(tmp_path / "run")
    assert one_line(err) == (
        f"{tmp_path}/run/metrics.jsonl: {4 << 30} bytes, over the 512 MiB limit for this run "
        "file; flash wrote no such file: pass a run dir flash wrote"
    )


def test_plot_refuses_one_huge_line_at_its_limit_naming_file_and_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n' + b"x" * (LOG_BOUNDS.line_bytes + 1) + b"\n")
    with pytest.raises(RunFileError) as err:
        load_run(run)
    assert one_line(err).startswith(f"{run}/metrics.jsonl:2: a line over 16 MiB (the limit for this run file)")


@pytest.mark.parametrize("name", ["metrics.jsonl", "timeline.jsonl", "eval.jsonl", "summary.json", "sweep_point.json"])
def test_plot_refuses_a_deeply_nested_line_without_a_recursion_error(tmp_path, name):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).write_bytes(b'{"step": 0}\n' * name.endswith(".jsonl") + DEEP + b"\n")
    with pytest.raises(RunFileError) as err:
        load_run(run)
    line = 2 if name.endswith(".jsonl") else None
    where = f"{run}/{name}" + (f":{line}" if line else "")
    assert one_line(err) == (
        f"{where}: JSON nested more than 32 deep (the limit for a run file); flash wrote no "
        "such line: pass a run dir flash wrote"
    )


def test_plot_refuses_a_line_that_is_not_an_object_or_not_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(RunFileError, match=r"metrics.jsonl:2: a list, not a JSON object"):
        load_run(run)
    (run / "metrics.jsonl").write_text('{"step": 0}\n\n{"step": \n')
    with pytest.raises(RunFileError, match=r"metrics.jsonl:3: not JSON \(JSONDecodeError: Expecting value"):
        load_run(run)


def test_flash_plot_says_it_in_one_line_with_no_traceback(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(DEEP + b"\n")
    assert main(["plot", str(run), "-o", str(tmp_path / "out.png")]) != 0
    err = capsys.readouterr().err.strip()
    assert err == (
        f"flash: error: {run}/metrics.jsonl:1: JSON nested more than 32 deep (the limit for a run file); flash "
        "wrote no such line: pass a run dir flash wrote"
    )
    assert not (tmp_path / "out.png").exists()


def test_replay_refuses_a_sparse_schedule_over_its_limit_and_a_deep_line(tmp_path):
    sparse(tmp_path / "schedule.jsonl", 65 << 30)
    with pytest.raises(RunFileError) as err:
        count_steps(tmp_path)
    assert one_line(err).startswith(f"{tmp_path}/schedule.jsonl: {65 << 30} bytes, over the 64 GiB limit")
    (tmp_path / "schedule.jsonl").write_bytes(b'{"step": 0}\n' + DEEP + b"\n")
    with pytest.raises(RunFileError, match=r"schedule.jsonl:2: JSON nested more than 32 deep"):
        count_steps(tmp_path)


def test_plan_refuses_a_gzipped_trace_whose_line_decompresses_past_the_limit(tmp_path):
    (tmp_path / "ledger.jsonl.gz").write_bytes(gzip.compress(b"a" * (20 << 20)))  # 20 KB on disk
    with pytest.raises(RunFileError) as err:
        plan_jsonl(tmp_path / "ledger.jsonl")
    assert one_line(err).startswith(f"{tmp_path}/ledger.jsonl.gz:1: a line over 16 MiB")


def test_sweep_refuses_a_deep_point_marker_in_one_line(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "sweep_point.json").write_bytes(DEEP)
    with pytest.raises(FlashError, match=r"sweep_point.json: JSON nested more than 32 deep"):
        prepare(Path("recipes/sim_rlvr.yaml"), [Point({}, [], "p")], tmp_path)


def test_resume_refuses_a_deep_or_aliased_or_huge_config_in_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("".join("  " * i + "k:\n" for i in range(40)) + "  " * 40 + "v: 1\n")
    with pytest.raises(FlashError) as err:
        saved_config(tmp_path)
    assert one_line(err).startswith(f"resume={tmp_path}: {tmp_path}/config.yaml: YAML nested more than 32 deep")
    (tmp_path / "config.yaml").write_text("a: &x [1, 2]\nb: [*x, *x]\n")
    with pytest.raises(FlashError, match=r"config.yaml: a YAML alias \(\*x\); flash writes none there"):
        saved_config(tmp_path)
    sparse(tmp_path / "config.yaml", 1 << 30)
    with pytest.raises(FlashError, match=rf"config.yaml: {1 << 30} bytes, over the 64 MiB limit"):
        saved_config(tmp_path)
    (tmp_path / "config.yaml").write_text("seed: 3\ntrain: {steps: 2}\n")
    assert saved_config(tmp_path) == {"seed": 3, "train": {"steps": 2}}


def test_a_checkpoint_manifest_or_state_nested_deep_is_refused_by_its_bounds(tmp_path):
    (tmp_path / "manifest.json").write_bytes(DEEP)
    with pytest.raises(ValueError, match=r"^manifest.json: JSON nested more than 32 deep"):
        read_manifest(tmp_path)
    (tmp_path / "state.json").write_bytes(DEEP)
    files = {"state.json": {"bytes": len(DEEP), "sha256": __import__("hashlib").sha256(DEEP).hexdigest()}}
    with pytest.raises(FlashError) as err:
        load_state(tmp_path, {"files": files, "step": 1})
    assert one_line(err).startswith(f"checkpoint {tmp_path}: state.json: JSON nested more than 32 deep")
    files["state.json"]["bytes"] = 5 << 30
    with pytest.raises(FlashError, match=r"state.json is 5368709120 bytes, over the 4 GiB limit"):
        load_state(tmp_path, {"files": files, "step": 1})


def test_a_run_file_read_back_through_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "elsewhere.jsonl", tmp_path / "run" / "metrics.jsonl")
    with pytest.raises(FlashError, match=r"metrics.jsonl is a symbolic link"):
        load_run(tmp_path / "run")
