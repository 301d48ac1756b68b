"""The GPU recipes validate on this CPU machine against stand-ins of what they read (a model folder of
the same architecture, GSM8K-format files), and say what they place where on their simulated GPUs."""

import pytest

from flash.app.cli import main
from flash.app.config import load_config
from flash.app.recipe_files import recipe_paths
from flash.errors import ConfigError
from flash.placement import plan_placement
from tests.helpers.standins import GPU_RECIPES, gpu_recipe_overrides


@pytest.mark.cpu_budget(5)  # fake-tensor traces of each GPU role's step (gsm8k_1gpu: 2.7 s of CPU on an AMD EPYC)
@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_recipe_validates_with_stand_ins(recipe, tmp_path, capsys):
    assert main(["validate", recipe, *gpu_recipe_overrides(tmp_path, recipe)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {recipe_paths()[recipe]} (async_ratio=2.0")


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_recipe_opens_with_its_command_and_expectations(recipe):
    head = recipe_paths()[recipe].read_text().split("\ndescription:")[0]
    assert head.splitlines()[0].startswith(f"# flash run {recipe} model.path=models/{GPU_RECIPES[recipe]}")
    assert "Expect:" in head and "GB" in head and "s/step" in head


def test_one_gpu_recipe_colocates_a_torch_engine_with_the_trainer_in_bf16(tmp_path):
    cfg = load_config(recipe_paths()["gsm8k_1gpu"], gpu_recipe_overrides(tmp_path, "gsm8k_1gpu"))
    assert (cfg.model.dtype, cfg.rollout.engine, cfg.async_ratio) == ("bfloat16", "torch", 2.0)
    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    assert plan.colocated("actor_train", "actor_infer")
    assert plan.devices("actor_train") == plan.devices("actor_infer") == [0]


def test_one_gpu_recipe_runs_the_single_trainer_with_activation_checkpointing(tmp_path):
    """Activation checkpointing is a trainer knob: it asks for no FSDP2 group, so the recipe runs
    one plain trainer process (whose push into the colocated engine reads its live parameters)."""
    from flash.app.settings import trainer_settings
    from flash.train.fsdp import group_settings

    cfg = load_config(recipe_paths()["gsm8k_1gpu"], gpu_recipe_overrides(tmp_path, "gsm8k_1gpu"))
    assert cfg.train.activation_checkpointing is True
    assert group_settings(cfg.train) is None
    assert trainer_settings(cfg).activation_checkpointing is True


def test_eight_gpu_recipe_disaggregates_four_vllm_engines_from_four_fsdp2_ranks(tmp_path):
    cfg = load_config(recipe_paths()["gsm8k_8gpu"], gpu_recipe_overrides(tmp_path, "gsm8k_8gpu"))
    assert (cfg.model.dtype, cfg.rollout.engine, cfg.train.workers) == ("bfloat16", "vllm", 4)
    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    assert not plan.colocated("actor_train", "actor_infer")
    assert (plan.devices("actor_train"), plan.devices("actor_infer")) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert cfg.model_update.backend == "nccl"


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_recipe_without_its_model_folder_names_the_download(recipe, tmp_path):
    data = [o for o in gpu_recipe_overrides(tmp_path, recipe) if o.startswith("data.")]
    with pytest.raises(ConfigError, match=f"model.path=models/{GPU_RECIPES[recipe]} is not a local folder"):
        load_config(recipe_paths()[recipe], data)


def test_a_torch_engine_worker_given_two_gpus_is_refused_at_validate_naming_the_fix(tmp_path, capsys):
    stand_ins = gpu_recipe_overrides(tmp_path, "gsm8k_8gpu")
    wide = ["rollout.engine=torch", "placement.roles.actor_infer.num_workers=2", "model_update.backend=auto"]
    capsys.readouterr()
    assert main(["validate", "gsm8k_8gpu", *stand_ins, *wide]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert (
        "placement.roles.actor_infer gives each worker 2 devices (w0: [4, 5]), but the torch engine runs on "
        "one: set placement.roles.actor_infer.num_workers=4 (one replica per device), or rollout.engine=vllm" in err
    )
    assert (
        main(["validate", "gsm8k_8gpu", *stand_ins, "placement.roles.actor_infer.num_workers=2"]) == 0
    )  # vLLM: two tensor-parallel ranks each
