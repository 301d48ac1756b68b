"""A user's loss, written in their own module and named only in YAML, trains the default recipe."""

import json
import sys
import textwrap

import ray

from flash.algos.policy import LOSSES
from flash.app.config import load_config
from flash.app.runner import run

PLUGIN = textwrap.dedent("""
    from flash import algos

    CALLS = []

    @algos.register_loss("scaled_pg_test", description="REINFORCE with a scale, from a test plugin")
    def scaled_pg_test(inputs, *, scale: float = 1.0):
        return -scale * inputs.advantages * inputs.logp, {"plugin_scale": scale}
""")


def test_plugin_loss_named_in_yaml_trains(tmp_path):
    mod_dir = tmp_path / "plugmods"
    mod_dir.mkdir()
    (mod_dir / "my_flash_plugin.py").write_text(PLUGIN)
    sys.path.insert(0, str(mod_dir))
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        textwrap.dedent(f"""
        # flash run {recipe}
        description: plugin loss test
        plugins: [my_flash_plugin]
        async_ratio: 1
        algo:
          loss: {{name: scaled_pg_test, scale: 0.5}}
        sft: {{steps: 40, eval_after: false}}
        model: {{tiny: {{num_layers: 2}}}}
        train: {{steps: 3, prompts_per_step: 4}}
        rollout: {{n: 4, max_new_tokens: 32}}
        task: {{name: chainsum, eval_size: 8}}
        tracking: {{tensorboard: false, progress: false}}
        resources: {{engine_threads: 1, trainer_threads: 1}}
        cache_dir: {tmp_path / "cache"}
        run_dir: {tmp_path / "run"}
    """)
    )
    try:
        cfg = load_config(recipe)
        summary = run(cfg, "plugin")
    finally:
        sys.path.remove(str(mod_dir))
        sys.modules.pop("my_flash_plugin", None)
        if "scaled_pg_test" in LOSSES:  # later tests (every built-in loss's hand case) see the built-ins
            LOSSES.unregister("scaled_pg_test")
        if ray.is_initialized():
            ray.shutdown()
    assert summary["steps"] == 3 and summary["loss"] == "scaled_pg_test"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the plugin's own metric, carrying the YAML knob, came back from the trainer actor every step
    assert [r["train/plugin_scale"] for r in rows] == [0.5, 0.5, 0.5]
