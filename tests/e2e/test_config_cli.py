"""Strict config and the CLI: typos name the right key, bad values and missing recipes exit non-zero.
(Recipe files themselves, their bases and plugins: test_config_recipes.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash.app.cli import main
from flash.app.recipe_files import recipe_paths
from flash.app.config import load_config
from flash.errors import ConfigError
from flash.gguf import MissingModelPackage
from tests.helpers.standins import GPU_RECIPES, gpu_recipe_overrides

RECIPES = sorted(recipe_paths().values())
STUTTER = recipe_paths()["stutter"]  # the default recipe: its task has slip_prob


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_validates_and_opens_with_its_command(path, tmp_path):
    assert path.read_text().splitlines()[0].startswith(f"# flash run {path.stem}")
    # a GPU recipe reads a model folder and data files: stand-ins of the same kind (tests/unit/test_gpu_recipes.py)
    overrides = gpu_recipe_overrides(tmp_path, path.stem) if path.stem in GPU_RECIPES else []
    try:
        cfg = load_config(path, overrides)
    except MissingModelPackage as exc:  # a recipe on an optional extra's model (math_smollm2)
        pytest.skip(str(exc))
    assert cfg.description  # `flash ls` shows it


def test_overrides_are_typed_and_applied():
    cfg = load_config(STUTTER, ["async_ratio=0.5", "algo.loss.name=ppo", "algo.loss.clip_high=0.28", "train.steps=3"])
    assert cfg.async_ratio == 0.5 and cfg.train.steps == 3
    assert cfg.algo.loss == {"name": "ppo", "clip_high": 0.28}


def test_an_empty_mapping_override_empties_the_recipes_mapping():
    """Merging ``{}`` would keep the recipe's keys: ``reward.fn={}`` removes math.yaml's reward."""
    assert load_config("recipes/math.yaml").reward.fn == {"name": "math"}
    assert load_config("recipes/math.yaml", ["reward.fn={}"]).reward.fn == {}
    assert load_config("recipes/math.yaml", ["reward.fn={}", "reward.fn.name=code"]).reward.fn == {"name": "code"}


@pytest.mark.parametrize("override", ["data.reward=tests.reward_fns:exact", "data.reward_key=reward_fn"])
def test_a_rows_reward_beside_reward_fn_is_one_line_naming_the_fix(tmp_path, override):
    """reward.fn scores every row of a run: a data.reward or data.reward_key beside it would be
    silently ignored, so it is refused; ``reward.fn={}`` lets the rows' reward score."""
    (tmp_path / "a.jsonl").write_text('{"question": "1+1", "answer": "2", "reward_fn": "math"}\n')
    rows = [f"data.train=[{tmp_path}/a.jsonl]", "data.prompt_key=question", "data.sft_key=answer"]
    with pytest.raises(
        ConfigError, match=r"reward.fn \(math\) and data.reward(_key)? both choose .* set reward.fn=\{\}"
    ):
        load_config("recipes/math.yaml", [*rows, override])
    assert load_config("recipes/math.yaml", [*rows, override, "reward.fn={}"]).reward.fn == {}
    assert load_config("recipes/math.yaml", rows).reward.fn == {"name": "math"}  # data.reward left at its default


@pytest.mark.parametrize(
    "override, needle",
    [
        ("asyn_ratio=2", "did you mean 'async_ratio'"),
        ("rollout.temprature=0.5", "did you mean 'temperature'"),
        ("train.stpes=3", "did you mean 'steps'"),
        ("algo.loss.negative_wieght=0.3", "negative_weight"),
        ("algo.advantage.name=grop", "grpo"),
        ("task.slip_prb=0.1", "slip_prob"),
        ("algo.loss.name=decoupled_pp", "decoupled_ppo"),
    ],
)
def test_misspelled_keys_name_the_closest_valid_one(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(STUTTER, [override])
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("async_ratio=abc", "async_ratio"),
        ("async_ratio=-1", "async_ratio must be"),
        ("rollout.interrupt=pause", "rollout.interrupt must be one of"),
        ("train.steps=0", "train.steps"),
        ("algo.agg=token-sum", "algo.agg"),
        ("noequals", "key=value"),
    ],
)
def test_invalid_values_are_one_clear_error(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(STUTTER, [override])
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "train.grad_clip=-1",
        "train.grad_clip=0",
        "critic.grad_clip=-0.5",
        "sft.grad_clip=0",
        "critic.lr=-1e-3",
        "sft.lr=0",
        "train.weight_decay=-0.1",
        "critic.weight_decay=-1",
        "sft.weight_decay=-0.01",
    ],
)
def test_optimizer_knobs_that_would_reverse_or_zero_training_are_refused(override):
    """torch's clip_grad_norm_ multiplies by max_norm / norm: a max_norm of -1 ascends, 0 never moves."""
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]} must be"):
        load_config(STUTTER, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=-1", "seed must be in [0, 4294967295], got -1"),
        ("seed=18446744073709551616", "seed must be in [0, 4294967295]"),
        ("sft.seed=-2", "sft.seed must be in"),
        ("rollout.max_num_seqs=0", "rollout.max_num_seqs must be >= 1, got 0"),
        ("rollout.max_num_batched_tokens=-1", "rollout.max_num_batched_tokens must be >= 0, got -1"),
        ("eval.every_steps=-3", "eval.every_steps must be >= 0, got -3"),
        ("eval.temperature=-1", "eval.temperature must be >= 0"),
        ("sft.steps=-1", "sft.steps must be >= 0"),
        ("sft.batch_size=0", "sft.batch_size must be >= 1"),
        ("critic.micro_batch_size=0", "critic.micro_batch_size must be >= 1"),
        ("tracking.log_samples=-1", "tracking.log_samples must be >= 0"),
    ],
)
def test_counts_and_seeds_out_of_range_are_refused_at_validate(override, message):
    """A negative seed or zero max_num_seqs failed only inside a role after the run started; a
    negative eval.every_steps evaluated every |k| steps."""
    with pytest.raises(ConfigError) as err:
        load_config(STUTTER, [override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    "override",
    [
        "model.tiny.num_heads=0",
        "model.tiny.num_kv_heads=0",
        "model.tiny.num_layers=-1",
        "model.tiny.intermediate_size=0",
        "model.tiny.rope_theta=0",
    ],
)
def test_a_tiny_model_without_a_size_is_one_clear_error(override):
    """Zero heads divided by zero (a traceback); zero layers built a model that cannot learn."""
    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]} must be"):
        load_config(STUTTER, [override])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("agent.tool_parser=hermess", "did you mean 'hermes'"),
        ("agent.processes=-1", "agent.processes >= 0"),
        ("agent.header_timeout_s=0", "agent.header_timeout_s must be > 0"),
        ("agent.body_timeout_s=-1", "agent.body_timeout_s must be > 0"),
        ("agent.max_connections=0", "agent.max_connections must be >= 1"),
        ("task.env_concurrency=0", "env_concurrency must be >= 1"),
    ],
)
def test_agent_and_episode_settings_are_one_clear_error(override, needle):
    recipe = "recipes/calculator.yaml" if override.startswith("agent.") else "recipes/corridor.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_cli_errors_exit_nonzero_with_one_line(capsys):
    assert main(["validate", "stutter", "asyn_ratio=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "async_ratio" in err and "Traceback" not in err
    assert main(["run", "stuter"]) == 2
    assert "did you mean 'stutter'" in capsys.readouterr().err
    assert main(["validate", "nope/missing.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_ls_validate_and_losses(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "stutter" in out and "GRPO + TOPR" in out
    assert main(["validate", "stutter", "async_ratio=0"]) == 0
    assert "ok:" in capsys.readouterr().out
    assert main(["losses"]) == 0
    out = capsys.readouterr().out
    for name in ("vanilla", "ppo", "decoupled_ppo", "tis", "cispo", "topr", "gspo", "grpo", "rloo"):
        assert f"  {name} " in out


def test_console_script_is_installed():
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flash"), "validate", "stutter", "train.stpes=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "did you mean 'steps'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly_with_status_141():
    """``flash validate stutter | head -1``: no BrokenPipeError traceback, the shell's SIGPIPE status."""
    flash = str(Path(sys.executable).parent / "flash")
    # the reader gone before the first write: the write fails in every run, not only when it loses a race
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [flash, "validate", "stutter"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    # head -1's shape: the first line read, then the pipe closed (what is left may be written already)
    with subprocess.Popen([flash, "ls"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as ls:
        first = ls.stdout.readline()
        ls.stdout.close()
        err = ls.stderr.read()
    assert first.split()[0] in recipe_paths() and ls.returncode in (0, 141)
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_bad_override_is_named():
    with pytest.raises(ConfigError, match=r"^cannot parse override 'rollout.n=\[1,'"):
        load_config(STUTTER, ["async_ratio=1", "rollout.n=[1,"])
    with pytest.raises(ConfigError, match=r"^buffer.max_frame_mb=inf is not a finite number"):
        load_config(STUTTER, ["buffer.max_frame_mb=inf"])


def test_a_run_dir_holding_a_run_is_refused_unless_resumed_or_moved_aside(tmp_path, monkeypatch):
    from flash.app.resume import make_run_dir
    from flash.errors import FlashError

    old = tmp_path / "run"
    old.mkdir()
    (old / "sweep_point.json").write_text("{}")  # not a run: a sweep writes it before launching
    cfg = load_config(STUTTER, [f"run_dir={old}"])
    assert make_run_dir(cfg, "stutter") == old
    (old / "ledger.jsonl").write_text("the earlier run's ledger\n")
    with pytest.raises(
        FlashError,
        match=rf"run_dir {old} already holds a run \(ledger.jsonl\): "
        rf"continue it with resume={old}",
    ):
        make_run_dir(cfg, "stutter")
    assert make_run_dir(cfg, "stutter", resuming=True) == old
    assert (old / "ledger.jsonl").read_text() == "the earlier run's ledger\n"
    cfg = load_config(STUTTER, [f"run_dir={old}", "overwrite=true"])
    assert make_run_dir(cfg, "stutter") == old and list(old.iterdir()) == []
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert (aside / "ledger.jsonl").read_text() == "the earlier run's ledger\n"
    monkeypatch.chdir(tmp_path)  # unnamed runs started in the same second get distinct dirs
    default = load_config(STUTTER)
    dirs = [make_run_dir(default, "stutter") for _ in range(3)]
    assert len(set(dirs)) == 3 and all(d.parent == Path("runs") for d in dirs)


@pytest.mark.parametrize(
    "content, message",
    [
        (bytes(range(128, 256)), "not UTF-8 text"),
        (b"seed: !!python/object/apply:os.system ['true']\n", "cannot read"),
        (b"- 1\n- 2\n", "is not a run's config"),
    ],
)
def test_resume_from_a_dir_whose_config_flash_did_not_write_is_one_line(tmp_path, capsys, content, message):
    """A binary or non-mapping config.yaml in the resumed dir was a yaml/UnicodeDecodeError traceback."""
    (tmp_path / "config.yaml").write_bytes(content)
    assert main(["run", "stutter", f"resume={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and f"resume={tmp_path}" in err


def test_model_path_must_be_a_local_model_folder(tmp_path, capsys):
    assert main(["validate", "stutter", "model.path=Qwen/Qwen2.5-0.5B"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "flash: error: model.path=Qwen/Qwen2.5-0.5B is not a local folder: flash reads no model hub "
        "at run time; download it first (e.g. `huggingface-cli download Qwen/Qwen2.5-0.5B "
        "--local-dir models/Qwen2.5-0.5B`) and pass model.path=models/Qwen2.5-0.5B"
    )
    with pytest.raises(ConfigError, match=r"model.path=/nonexistent/model is not a local folder$"):
        load_config("recipes/stutter.yaml", ["model.path=/nonexistent/model"])
    with pytest.raises(ConfigError, match="has no config.json: point it at a Hugging Face model folder"):
        load_config("recipes/stutter.yaml", [f"model.path={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no weights .*; finish the download"):
        load_config("recipes/stutter.yaml", [f"model.path={tmp_path}"])
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load_config("recipes/stutter.yaml", [f"model.path={tmp_path}"])
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_config("recipes/stutter.yaml", [f"model.path={tmp_path}"]).model.path == str(tmp_path)


def test_data_export_to_a_folder_that_does_not_exist_is_one_line(tmp_path, capsys):
    """The writer's FileNotFoundError was a traceback."""
    out = tmp_path / "missing" / "deeper" / "words.jsonl"
    (tmp_path / "missing").write_text("a file, not a folder")
    assert main(["data", "export", "wordproblems", "-o", str(out), "--rows", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"flash: error: -o {out}: cannot write it")


@pytest.mark.parametrize(
    "argv",
    [
        ["data", "export", "wordproblems", "-o", "OUT", "--rows", "0"],
        ["data", "export", "wordproblems", "-o", "OUT", "--rows", "-3"],
        ["data", "stutter", "--rows", "-1"],
        ["replay", "RUN", "--steps", "-1"],
        ["replay", "RUN", "--steps", "0"],
    ],
)
def test_counts_on_the_command_line_must_be_at_least_one(tmp_path, capsys, argv):
    """--rows -3 wrote an empty file and said so; replay --steps -1 replayed all but the last step."""
    argv = [str(tmp_path / "w.jsonl") if a == "OUT" else str(tmp_path) if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "expected a whole number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "w.jsonl").exists()


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """A file at run_dir, or a path under one, was a FileExistsError / NotADirectoryError traceback."""
    taken = tmp_path / "taken"
    taken.write_text("a file")
    for run_dir in (taken, taken / "run"):
        assert main(["run", "stutter", f"run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"run_dir {run_dir}: cannot make it a folder" in err
    assert taken.read_text() == "a file"


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.engine=vlm", "rollout.engine must be one of torch, vllm, sim, got 'vlm' (did you mean 'vllm'?)"),
        (
            "rollout.interrupt=restrt",
            "rollout.interrupt must be one of continue, restart, wait, got 'restrt' (did you mean 'restart'?)",
        ),
        (
            "rollout.scheduler=tail_batchin",
            "rollout.scheduler must be one of plain, tail_batching, got 'tail_batchin' (did you mean 'tail_batching'?)",
        ),
        (
            "algo.recompute_prox=aprox",
            "algo.recompute_prox must be one of auto, always, never, approx, got 'aprox' (did you mean 'approx'?)",
        ),
        (
            "algo.agg=token-meen",
            "algo.agg must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum, "
            "seq-mean-token-sum-norm, got 'token-meen' (did you mean 'token-mean'?)",
        ),
        ("train.backend=sm", "train.backend must be one of torch, sim, got 'sm' (did you mean 'sim'?)"),
        (
            "train.lr_schedule=cosin",
            "train.lr_schedule must be one of constant, cosine, got 'cosin' (did you mean 'cosine'?)",
        ),
        (
            "model.dtype=bfloat61",
            "model.dtype must be one of float32, bfloat16, float16, got 'bfloat61' (did you mean 'bfloat16'?)",
        ),
        (
            "model_update.backend=glo",
            "model_update.backend must be one of auto, gloo, nccl, shm, cuda_ipc, object_store, got "
            "'glo' (did you mean 'gloo'?)",
        ),
        ("buffer.transport=zmg", "buffer.transport must be one of local, zmq, got 'zmg' (did you mean 'zmq'?)"),
        ("buffer.auth=curv", "buffer.auth must be one of curve, none, got 'curv' (did you mean 'curve'?)"),
        ("rollout.interrupt=1", "rollout.interrupt must be one of continue, restart, wait, got '1'"),
    ],
)
def test_a_choice_outside_its_literal_type_names_the_choices_and_the_closest(override, message):
    """Each choice is a Literal type in the schema, checked before the merge (docs/design.md invariant 6)."""
    with pytest.raises(ConfigError) as err:
        load_config(STUTTER, [override])
    assert str(err.value) == message


def test_a_built_config_is_checked_against_the_same_choices():
    import dataclasses

    from flash.app.config import validate

    cfg = load_config(STUTTER)
    cfg.rollout = dataclasses.replace(cfg.rollout, interrupt="pause")
    with pytest.raises(ConfigError, match=r"^rollout.interrupt must be one of continue, restart, wait, got 'pause'"):
        validate(cfg)


def test_the_valid_values_code_reads_are_the_schema_types_choices():
    from typing import get_args, get_type_hints

    from flash.buffers.factory import TRANSPORTS, BufferConfig
    from flash.controllers.prox_mode import PROX_SOURCES, RecomputeProx, prox_mode, trainer_prox
    from flash.controllers.tail_policy import SCHEDULERS
    from flash.app.schema import AlgoConfig, ModelUpdateConfig, RolloutConfig, TrainConfig
    from flash.engine.base import INTERRUPT_MODES
    from flash.engine.torch_worker import ENGINES
    from flash.train.updates import LR_SCHEDULES
    from flash.weights.model_update import BACKENDS

    def choices(cls, name):
        return get_args(get_type_hints(cls)[name])

    assert choices(RolloutConfig, "interrupt") == INTERRUPT_MODES == ("continue", "restart", "wait")
    assert choices(RolloutConfig, "engine") == ENGINES == ("torch", "vllm", "sim")
    assert choices(RolloutConfig, "scheduler") == SCHEDULERS == ("plain", "tail_batching")
    assert choices(TrainConfig, "lr_schedule") == LR_SCHEDULES == ("constant", "cosine")
    assert choices(ModelUpdateConfig, "backend") == BACKENDS
    assert choices(BufferConfig, "transport") == TRANSPORTS == ("local", "zmq")
    assert choices(AlgoConfig, "recompute_prox") == get_args(RecomputeProx)
    # algo.recompute_prox read once: where prox comes from at r = 0 and r > 0, and the trainer's part
    table = {mode: (prox_mode(mode, 0.0), prox_mode(mode, 1.0), trainer_prox(mode)) for mode in get_args(RecomputeProx)}
    assert table == {
        "auto": ("behav", "fused", "fused"),
        "always": ("separate", "separate", "fused"),
        "never": ("behav", "behav", "fused"),
        "approx": ("approx", "approx", "approx"),
    }
    assert {s for row in table.values() for s in row[:2]} == set(PROX_SOURCES)


@pytest.mark.parametrize("old, dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_a_config_written_with_train_mixed_precision_reads_as_model_dtype(tmp_path, old, dtype):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"base: {STUTTER}\ntrain: {{mixed_precision: {old}}}\n")
    assert load_config(recipe).model.dtype == dtype
    recipe.write_text(f"base: {STUTTER}\nmodel: {{dtype: float16}}\ntrain: {{mixed_precision: bf16}}\n")
    with pytest.raises(ConfigError, match="train.mixed_precision=bf16 and model.dtype=float16 disagree"):
        load_config(recipe)


def test_a_run_driver_and_validate_load_no_model_code():
    """`flash validate` and a run's driver read configs, tokenizers and talk to actors: neither
    imports transformers' modeling code (the Qwen2 model, the KV-cache utilities and, with them,
    torch._dynamo), which only the processes that build a model need."""
    code = (
        "import sys; import flash.app.runner, flash.app.cli, flash.app.preflight; "
        "from flash.app.cli import main; sys.argv = ['flash', 'validate', 'stutter']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = ('transformers.models.qwen2.modeling_qwen2', 'transformers.cache_utils', "
        "'transformers.modeling_utils', 'torch._dynamo')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
