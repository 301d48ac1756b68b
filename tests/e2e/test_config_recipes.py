"""Recipe files: a bad one is one line naming the file and line; a recipe builds on another with
``base``; plugins beside the recipe load by name or .py path, and one that does not parse is one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash.app.cli import main
from flash.app.config import load_config
from flash.errors import ConfigError


@pytest.mark.parametrize(
    "text, message",
    [
        ("- task\n- rollout\n", r"a recipe is a mapping of sections .*, not a list"),
        ("just words\n", r"unknown config key 'just words'"),
        (
            "task: !!python/object/apply:os.system ['touch /tmp/flash-pwned']\n",
            r"line 1 column 7: could not determine a constructor for the tag",
        ),
        ("task: {name: stutter\nrollout: {n: 2}\n", r"line 2 column 8: "),
        ("", r"is empty: a recipe names at least its task"),
        ("# only a comment\n", r"is empty"),
        ("task: {name: stutter}\nrollout: {temperature: .inf}\n", r"^rollout.temperature=inf is not a finite"),
        ("task: {name: stutter}\ntrain: {lr: .nan}\n", r"^train.lr=nan is not a finite number"),
    ],
)
def test_a_bad_recipe_file_is_one_line_naming_file_and_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    assert main(["validate", str(path)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not Path("/tmp/flash-pwned").exists()


def test_a_recipe_builds_on_another_with_base(tmp_path, capsys):
    stutter = load_config("recipes/stutter.yaml")
    (tmp_path / "mine.yaml").write_text("base: stutter\ndescription: mine\ntrain: {steps: 7}\n")
    mine = load_config(tmp_path / "mine.yaml")
    assert mine.train.steps == 7 and mine.description == "mine"
    assert (mine.async_ratio, mine.algo.loss, mine.rollout.n) == (
        stutter.async_ratio,
        stutter.algo.loss,
        stutter.rollout.n,
    )
    (tmp_path / "more.yaml").write_text("base: mine.yaml\nrollout: {n: 2}\n")  # a path beside it
    more = load_config(tmp_path / "more.yaml", ["train.steps=9"])
    assert (more.train.steps, more.rollout.n, more.algo.loss) == (9, 2, stutter.algo.loss)
    assert main(["validate", str(tmp_path / "more.yaml"), "train.steps=9"]) == 0
    out = capsys.readouterr().out.splitlines()  # the resolved config against its base (mine.yaml)
    assert out[1:] == ["differs from its base in 2 settings:", "  rollout.n: 8 -> 2", "  train.steps: 7 -> 9"], out
    # a mapping at its empty default is no difference; the entries a recipe adds to it are
    (tmp_path / "sets.yaml").write_text("base: stutter\neval: {sets: {more: {task: stutter}}}\n")
    assert main(["validate", str(tmp_path / "sets.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["differs from its base in 1 settings:", "  eval.sets.more.task: '(unset)' -> 'stutter'"], out
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert main(["validate", str(tmp_path / "a.yaml")]) == 2
    assert "recipe bases go round" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("base: [stutter]\n")
    with pytest.raises(ConfigError, match="base must be a recipe name or a file path"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "typo.yaml").write_text("base: stuter\n")
    with pytest.raises(Exception, match="no recipe named 'stuter'.*stutter"):
        load_config(tmp_path / "typo.yaml")


def test_a_plugin_beside_the_recipe_is_found_without_pythonpath(tmp_path):
    (tmp_path / "my_losses.py").write_text(
        "from flash import algos\n\n@algos.register_loss('my_pg', description='scaled REINFORCE')\n"
        "def my_pg(inputs, *, scale: float = 1.0):\n    return -scale * inputs.advantages * inputs.logp, {}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    flash = Path(sys.executable).with_name("flash")  # the console script: its sys.path lacks the cwd
    out = subprocess.run(
        [
            str(flash),
            "validate",
            str(Path(__file__).parents[2] / "recipes" / "stutter.yaml"),
            "plugins=[my_losses]",
            "algo.loss.name=my_pg",
            "algo.loss.scale=0.5",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: ") and "loss=my_pg" in out.stdout


def test_plugins_and_rewards_beside_a_recipe_in_another_folder_load_by_name_or_py_path(tmp_path, monkeypatch):
    """The recipe's folder, not the working directory: cwd is the checkout here. The plugin's loss
    registers into a copy of the registry, so later tests see the built-in losses only."""
    from flash.algos.policy import LOSSES

    monkeypatch.setattr(LOSSES, "_entries", dict(LOSSES._entries))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "beside_losses.py").write_text(
        "from flash import algos\n\n@algos.register_loss('beside_pg', description='scaled REINFORCE')\n"
        "def beside_pg(inputs, *, scale: float = 1.0):\n    return -scale * inputs.advantages * inputs.logp, {}\n"
    )
    (tmp_path / "beside_rewards.py").write_text("def length(item, response):\n    return float(len(response))\n")
    (tmp_path / "mine.yaml").write_text(
        "base: stutter\nplugins: [lib/beside_losses.py]\n"
        "algo: {loss: {name: beside_pg}}\nreward: {fn: {name: 'beside_rewards:length'}}\n"
    )
    cfg = load_config(tmp_path / "mine.yaml")
    assert cfg.plugins == [str(tmp_path / "lib" / "beside_losses.py")] and cfg.algo.loss["name"] == "beside_pg"
    (tmp_path / "lib" / "named.yaml").write_text(
        "base: stutter\nplugins: [beside_losses]\nalgo: {loss: {name: beside_pg}}\n"
    )
    assert load_config(tmp_path / "lib" / "named.yaml").plugins == [str(tmp_path / "lib" / "beside_losses.py")]
    (tmp_path / "bad.yaml").write_text("base: stutter\nplugins: [nowhere_losses]\n")
    with pytest.raises(
        ConfigError,
        match=r"'nowhere_losses' could not be imported: .*\(searched: .*"
        r"put it beside the recipe, give its .py path",
    ):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "bad2.yaml").write_text("base: stutter\nplugins: [lib/missing.py]\n")
    with pytest.raises(ConfigError, match=f"plugins: no such file {tmp_path}/lib/missing.py"):
        load_config(tmp_path / "bad2.yaml")


def test_a_plugin_file_that_does_not_parse_is_one_line_naming_file_and_line(tmp_path, capsys):
    """A SyntaxError in the user's plugin was the importer's traceback."""
    plugin = tmp_path / "my_losses.py"
    plugin.write_text("from flash import algos\n\ndef my_pg(inputs:\n")
    assert main(["validate", "stutter", f"plugins=[{plugin}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"plugin {plugin} line 3" in err
