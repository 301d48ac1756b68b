"""A recipe file reads only what the user named: no environment variable the command line does not
allow (``allow_env=[VAR]``), no resolver that reads files or code, ``base:`` only recipe files,
``model.chat_template`` only bounded Jinja text files, errors that never print another file's
text, and interpolations whose results are bounded."""

import sys

import pytest
import yaml

from flash.app.config import load_config, to_yaml
from flash.app.interpolation import MAX_CHARS, MAX_DEPTH, resolve
from flash.app.sweep import parse_grid
from flash.errors import ConfigError
from flash.models import MAX_TEMPLATE_BYTES, build_tokenizer, set_chat_template

SECRET = "hunter2-s3cr3t-value"


def recipe(tmp_path, text: str, name: str = "mine.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_recipe_reads_an_environment_variable_only_when_the_command_line_allows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_TEST_TOKEN", SECRET)
    path = recipe(tmp_path, "base: stutter\ndescription: key ${oc.env:FLASH_TEST_TOKEN}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: description reads the environment variable FLASH_TEST_TOKEN (oc.env), which the command line "
        f"does not allow: pass allow_env=[FLASH_TEST_TOKEN] to allow it, or set that key on the command line"
    )
    assert SECRET not in str(err.value)
    with pytest.raises(ConfigError, match="FLASH_TEST_TOKEN"):
        load_config(path, ["allow_env=[OTHER_VAR]"])
    for allowed in ("allow_env=FLASH_TEST_TOKEN", "allow_env=[OTHER_VAR,FLASH_TEST_TOKEN]"):
        cfg = load_config(path, [allowed])
        assert cfg.description == f"key {SECRET}"
        assert "allow_env" not in yaml.safe_load(to_yaml(cfg))  # names what one start allows, not the run
    # the command line's own overrides are the user's: they read what they name
    cfg = load_config(
        "recipes/stutter.yaml", ["description=${oc.env:FLASH_TEST_TOKEN}", "train.steps=${oc.decode:'7'}"]
    )
    assert cfg.description == SECRET and cfg.train.steps == 7


@pytest.mark.parametrize(
    "text, resolver",
    [
        ("description: ${oc.decode:'\\${oc.env:FLASH_TEST_TOKEN}'}\n", "oc.decode"),
        ("description: '${oc.create:{a: 1}}'\n", "oc.create"),
        ("description: ${oc.coerce:flash_probe_module.X,1}\n", "oc.coerce"),
        ("description: ${now:%Y}\n", "now"),
    ],
)
def test_a_recipe_may_use_no_resolver_that_decodes_text_or_imports_code(tmp_path, monkeypatch, text, resolver):
    monkeypatch.setenv("FLASH_TEST_TOKEN", SECRET)
    (tmp_path / "flash_probe_module.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.ran').write_text('imported')\nX = int\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = recipe(tmp_path, "base: stutter\n" + text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: description uses the resolver {resolver}, which a recipe file may not (it "
        f"may read the environment, files or code); set that key on the command line instead"
    )
    assert not (tmp_path / "flash_probe_module.ran").exists() and "flash_probe_module" not in sys.modules


def test_allow_env_is_the_command_line_s_never_a_recipe_s(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_TEST_TOKEN", SECRET)
    path = recipe(tmp_path, "base: stutter\nallow_env: [FLASH_TEST_TOKEN]\ndescription: ${oc.env:FLASH_TEST_TOKEN}\n")
    with pytest.raises(ConfigError, match=r"allow_env is the command line's to give, not a file's"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^allow_env: 'A-B' is not an environment variable's name"):
        load_config("recipes/stutter.yaml", ["allow_env=A-B"])
    fixed, swept = parse_grid(["allow_env=A,B", "async_ratio=0,1"])  # a sweep allows both in every run
    assert fixed == ["allow_env=A,B"] and swept == {"async_ratio": ["0", "1"]}


def test_trusting_a_checkpoint_is_the_command_line_s_never_a_recipe_s(tmp_path):
    path = recipe(tmp_path, "base: stutter\ntrust_checkpoint: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: trust_checkpoint is the command line's to give, not a file's: remove it "
        f"and pass trust_checkpoint=true after the recipe if you trust the checkpoint"
    )
    assert load_config(recipe(tmp_path, "base: stutter\ntrust_checkpoint: false\n")).trust_checkpoint is False
    assert load_config("recipes/stutter.yaml", ["trust_checkpoint=true"]).trust_checkpoint is True


def test_a_base_is_a_recipe_file_and_its_errors_never_print_the_file_s_text(tmp_path):
    (tmp_path / "notes.txt").write_text(f"{SECRET} line one\nline two\n")
    path = recipe(tmp_path, f"base: {tmp_path}/notes.txt\ntask: {{name: stutter}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: base: '{tmp_path}/notes.txt' is neither a recipe's name (`flash ls`) nor a .yaml/.yml recipe file"
    )
    (tmp_path / "creds.yaml").write_text(f"{SECRET}: 1\naws: {{key: abc}}\n")  # YAML, but no recipe
    path = recipe(tmp_path, "base: creds.yaml\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"base: {tmp_path}/creds.yaml is not a recipe (its top-level keys are not flash's "
        f"sections: task, rollout, train, ...)"
    )
    (tmp_path / "big.yaml").write_text("description: " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"big.yaml: 1048590 bytes, more than a recipe holds \(1048576\)$"):
        load_config(recipe(tmp_path, "base: big.yaml\n"))
    (tmp_path / "binary.yaml").write_bytes(b"description: \xff\xfe" + SECRET.encode())
    with pytest.raises(ConfigError) as err:
        load_config(recipe(tmp_path, "base: binary.yaml\n"))
    assert str(err.value) == f"cannot read {tmp_path}/binary.yaml: not UTF-8 text"


def test_model_chat_template_names_only_a_bounded_jinja_text_file(tmp_path):
    tok = build_tokenizer()
    own = tok.chat_template
    (tmp_path / "id_rsa").write_text(f"-----BEGIN KEY-----\n{SECRET}\n")
    (tmp_path / "notes.txt").write_text(f"{SECRET}\n")
    (tmp_path / "big.jinja").write_text("{{ x }}" * (MAX_TEMPLATE_BYTES // 7 + 1))
    refused = {
        "id_rsa": f"model.chat_template '{tmp_path}/id_rsa' is neither a Jinja template nor a template file "
        f"(.jinja, .jinja2, .j2, .txt)",
        "notes.txt": f"model.chat_template: {tmp_path}/notes.txt holds no Jinja ({{{{ ... }}}} or {{% ... %}}): "
        f"not a chat template",
        "big.jinja": f"model.chat_template: {tmp_path}/big.jinja is over {MAX_TEMPLATE_BYTES} bytes, more than a "
        f"chat template holds",
    }
    for name, message in refused.items():
        with pytest.raises(ValueError) as err:
            set_chat_template(tok, str(tmp_path / name))
        assert str(err.value) == message and SECRET not in str(err.value) and tok.chat_template == own
        with pytest.raises(ConfigError) as err:  # `flash validate` says so before any tokenizer loads
            load_config("recipes/stutter.yaml", [f"model.chat_template={tmp_path / name}"])
        assert str(err.value) == message
    (tmp_path / "mine.j2").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    set_chat_template(tok, str(tmp_path / "mine.j2"))
    assert tok.chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"


def doubling(levels: int, container: bool = False) -> str:
    """A recipe whose task key ``k<i>`` holds ``k<i-1>`` twice: 2**levels copies of 16 characters."""
    lines = ["base: stutter", "task:", "  name: stutter", "  k0: xxxxxxxxxxxxxxxx"]
    for i in range(1, levels + 1):
        lines.append(
            f"  k{i}: ['${{..k{i - 1}}}', '${{..k{i - 1}}}']" if container else f"  k{i}: ${{.k{i - 1}}}${{.k{i - 1}}}"
        )
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("container", [False, True])
def test_a_small_recipe_of_nested_interpolations_is_one_line_not_a_memory_error(tmp_path, container):
    text = doubling(30, container)
    assert len(text) < 1024
    path = recipe(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    key = "task.k17.0" if container else "task.k17"  # 2**16 copies of 16 characters: a MiB
    assert (
        str(err.value) == f"{path}: '{key}': interpolations there take in over {MAX_CHARS} characters; refer to "
        f"fewer values"
    )


def test_interpolations_resolve_as_omegaconf_does_each_once_and_leave_none_behind(tmp_path):
    path = recipe(
        tmp_path,
        "base: stutter\ndescription: ${.train.steps} steps of ${task.name}, "
        "${oc.select:nowhere,none}, \\${literal}\neval: {sets: {a: {task: '${task.name}'}}}\n",
    )
    cfg = load_config(path, ["train.steps=9"])
    assert cfg.description == "9 steps of stutter, none, ${literal}"
    assert cfg.eval.sets["a"]["task"] == "stutter"
    assert resolve(
        {"a": {"b": 1, "c": 2}, "keys": "${oc.dict.keys:a}", "vals": "${oc.dict.values:a}", "x": "\\\\${a.b}"}
    ) == {"a": {"b": 1, "c": 2}, "keys": ["b", "c"], "vals": [1, 2], "x": "\\1"}
    chain = {f"k{i}": f"${{k{i - 1}}}" for i in range(MAX_DEPTH + 1, 0, -1)} | {"k0": "v"}  # the longest first
    with pytest.raises(
        ConfigError,
        match=rf"^'k{MAX_DEPTH + 1}': interpolations refer through more than "
        rf"{MAX_DEPTH} keys \(to 'k1'\); write the value out$",
    ):
        resolve(chain)
    with pytest.raises(ConfigError, match=r"^'a': interpolations go round \(a -> b -> a\); break the loop$"):
        resolve({"a": "${b}", "b": "x${a}"})


def test_interpolations_nested_past_python_s_recursion_are_one_line(tmp_path):
    path = recipe(tmp_path, "base: stutter\ndescription: " + "${oc.select:" * 400 + "x" + "}" * 400 + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"cannot read {path}: its values or interpolations nest too deep"
