"""TF32 matmuls for float32 runs on a GPU, never on the CPU (``flash.devices.tf32_wanted``): the
decision for each device and dtype, the trainer's setting, and the engine workers' environment."""

from __future__ import annotations

import copy

import torch

from flash.app.config import load_config
from flash.app.recipe_files import recipe_paths
from flash.app.roles import engine_options
from flash.app.settings import trainer_settings
from flash.devices import TF32_ENV, tf32_env, tf32_wanted, use_tf32
from flash.placement import plan_placement
from tests.helpers.standins import gpu_recipe_overrides
from tests.helpers.checkpointing import small_trainer


def test_tf32_only_for_float32_on_cuda_with_the_knob_on():
    assert tf32_wanted("cuda:0", "float32", True) is True
    assert tf32_wanted(torch.device("cuda", 2), "float32", True) is True
    assert tf32_wanted("cpu", "float32", True) is False
    assert tf32_wanted("cuda:0", "bfloat16", True) is False
    assert tf32_wanted("cuda:0", "float32", False) is False
    assert TF32_ENV == {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    assert tf32_env((4,), "float32", True) == TF32_ENV and tf32_env((), "float32", True) == {}
    assert tf32_env((4, 5), "bfloat16", True) == {} and tf32_env((4,), "float32", False) == {}


def test_a_cpu_trainer_keeps_full_float32_matmuls():
    before = torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision()
    assert use_tf32("cpu", "float32", True) is False
    assert small_trainer().tf32 is False
    assert (torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision()) == before


def test_the_knob_reaches_the_trainer_and_the_engine_workers_environment(tmp_path):
    base = gpu_recipe_overrides(tmp_path, "gsm8k_8gpu") + ["model.dtype=float32"]
    cfg = load_config(recipe_paths()["gsm8k_8gpu"], base)
    assert cfg.resources.tf32 is True and trainer_settings(cfg).tf32 is True
    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    placed = {"num_gpus": 1.0, "runtime_env": {"env_vars": {"FLASH_DEVICES": "4"}}}
    got = engine_options(cfg, plan, placed, 0)
    assert got["runtime_env"]["env_vars"] == {"FLASH_DEVICES": "4", **TF32_ENV} and got["num_gpus"] == 1.0
    assert placed["runtime_env"]["env_vars"] == {"FLASH_DEVICES": "4"}  # the placement's own left as it is
    off = copy.deepcopy(cfg)
    off.resources.tf32 = False
    assert trainer_settings(off).tf32 is False and engine_options(off, plan, placed, 0) == placed
    bf16 = copy.deepcopy(cfg)
    bf16.model.dtype = "bfloat16"
    assert engine_options(bf16, plan, placed, 0) == placed
