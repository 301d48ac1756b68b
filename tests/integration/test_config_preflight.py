"""`flash validate` refuses whatever `flash run` refuses before it starts (flash.app.preflight).

Each row is a setting `flash run` refuses before its warm start and roles: the run is called with
the warm start and the roles replaced by a failure, so a refusal that came only after the start
fails the test; `flash validate` must then exit 2 with the same message.
"""

import json
import os

import pytest

from flash.app import runner
from flash.app.cli import main
from flash.app.config import load_config, to_yaml
from flash.app.recipe_files import resolve_recipe
from flash.errors import FlashError


def _held_run(tmp):
    (tmp / "held").mkdir()
    (tmp / "held" / "ledger.jsonl").write_text("{}\n")


def _linked_run(tmp):
    (tmp / "linked").mkdir()
    os.symlink(tmp / "elsewhere.jsonl", tmp / "linked" / "metrics.jsonl")  # dangling: held_run sees no run


def _other_run(tmp):
    (tmp / "other").mkdir()
    (tmp / "other" / "config.yaml").write_text(to_yaml(load_config(resolve_recipe("stutter"), ["seed=5"])))


def _chat_rows(tmp):
    rows = [{"messages": [{"role": "user", "content": "add 1 and 2."}], "answer": "3"}] * 3
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _chat_rows_and_a_model_without_template(tmp):
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

    _chat_rows(tmp)
    tok = build_tokenizer()
    tok.chat_template = None
    build_tiny_model(tok, TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2)).save_pretrained(
        tmp / "m"
    )
    tok.save_pretrained(tmp / "m")


def _no_namespaces(monkeypatch):
    from flash.rewards import sandbox

    monkeypatch.setattr(sandbox, "isolation_level", lambda: "audit-hook")
    monkeypatch.setitem(sandbox._POLICY, "allow_unisolated", False)


REFUSALS = [  # (recipe, overrides ({tmp}: a fresh folder), setup, message fragment)
    ("corridor", ["rollout.max_new_tokens=3"], None, "rollout.max_new_tokens is the tokens of one LLM turn"),
    ("corridor", ["eval.max_new_tokens=7"], None, "eval.max_new_tokens must be 0 or 1 (one action)"),
    ("corridor", ["rollout.scheduler=tail_batching"], None, "works on single-turn tasks"),
    ("stutter", ["resume=latest"], None, "resume=latest: no run of recipe 'stutter'"),
    ("stutter", ["resume={tmp}/none"], None, "resume={tmp}/none: not a run dir"),
    (
        "stutter",
        ["resume={tmp}/other", "seed=0"],
        _other_run,
        "settings differ from the checkpointed run (seed: 5 -> 0",
    ),
    ("stutter", ["run_dir={tmp}/held"], _held_run, "run_dir {tmp}/held already holds a run (ledger.jsonl)"),
    (
        "stutter",
        ["run_dir={tmp}/linked"],
        _linked_run,
        "run_dir {tmp}/linked holds {tmp}/linked/metrics.jsonl, a symbolic link to",
    ),
    (
        "math",
        ["data.train=[{tmp}/chat.jsonl]", "data.prompt_key=messages", "data.holdout=0", "model.path={tmp}/m"],
        _chat_rows_and_a_model_without_template,
        "the tokenizer has no chat template",
    ),
    ("code", [], "no_namespaces", "this host gives the code sandbox no namespaces"),
]


@pytest.mark.parametrize("recipe, overrides, setup, fragment", REFUSALS, ids=lambda v: str(v)[:40])
def test_validate_refuses_what_run_refuses_before_it_starts(
    tmp_path, monkeypatch, capsys, recipe, overrides, setup, fragment
):
    monkeypatch.chdir(tmp_path)  # resume=latest looks under ./runs
    if setup == "no_namespaces":
        _no_namespaces(monkeypatch)
    elif setup is not None:
        setup(tmp_path)
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    fragment = fragment.format(tmp=tmp_path)
    path = resolve_recipe(recipe)

    def started(*_args, **_kwargs):
        raise AssertionError("the run got past its pre-start checks")

    monkeypatch.setattr(runner, "prepare_model", started)
    monkeypatch.setattr(runner, "start_roles", started)
    with pytest.raises(FlashError) as refused:
        runner.run(load_config(path, overrides), recipe_name=path.stem)
    assert fragment in str(refused.value)
    assert not (tmp_path / "runs").exists()  # refused before a run dir was made

    assert main(["validate", recipe, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flash: error: {refused.value}"


def test_validate_accepts_what_run_starts():
    """A control: the same checks pass the shipped recipe (preflight returns the task it built)."""
    from flash.app.preflight import preflight

    cfg = load_config(resolve_recipe("corridor"))
    checked = preflight(cfg, "corridor")
    assert checked.resume_dir is None and checked.task.name == "corridor"
