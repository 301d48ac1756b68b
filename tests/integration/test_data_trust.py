"""Untrusted data (flash.data.rows/limits/trust, flash.rewards.math_limits): templates that reach
into objects or render gigabytes, rows that crash or stall a parser, and data paths that point
elsewhere. Each class is refused with one line naming the fix, or skipped and counted by reason."""

import json
import os
from collections import Counter

import pytest

from flash.app.config import load_config
from flash.app.data_preview import scan
from flash.app.roles import new_guards
from flash.data.files import datasets_module, open_rows
from flash.data.limits import MAX_DEPTH, MAX_ROW_BYTES
from flash.data.rows import MAX_TEMPLATE_WIDTH, BadRow, parse_template, render_template
from flash.errors import ConfigError
from flash.guards import DataError, json_depth
from flash.models import build_tokenizer
from flash.rewards.builtin import math_reward
from flash.rewards.math_limits import MAX_MATH_CHARS, MAX_PAREN_DEPTH, MathChecker, MathTooComplex, paren_depth
from flash.tasks import TaskItem
from flash.recipes.tasks import make_task


def rows(n=6):
    return [{"question": f"what is {i} plus 1?", "answer": f"#### {i + 1}", "id": i} for i in range(n)]


def write_lines(path, lines):
    path.write_bytes(
        b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    )
    return str(path)


def one_line_error(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kw)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    return str(err.value)


# ---- data.template ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, words",
    [
        ("{a:{b.__class__}}", "field inside its format spec"),
        ("Q: {q:>{w}}", "field inside its format spec"),
        ("{a.__class__}", "plain column name"),
        ("{a.__init__.__globals__}", "plain column name"),
        ("{a[0]}", "plain column name"),
        ("{a[__class__]}", "plain column name"),
        ("{0}", "plain column name"),
        ("{}", "plain column name"),
        ("{a!r}", "conversion (!r)"),
        ("{a!s:>3}", "conversion (!s)"),
        ("{q:>1000000000}", "width 1000000000, over 4096"),
        ("{q:.999999999}", "precision 999999999, over 4096"),
        ("{q:0" + "9" * 5000 + "}", "width 999999999999, over 4096"),
        (f"{{q:^{MAX_TEMPLATE_WIDTH + 1}}}", f"width {MAX_TEMPLATE_WIDTH + 1}"),
        ("{q:not a spec}", "invalid format spec"),
        ("{q", "not a valid format string"),
        ("plain text", "uses no column"),
    ],
)
def test_a_template_field_that_is_not_a_plain_column_with_a_bounded_spec_is_one_line(template, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        parse_template(template)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_a_template_renders_without_attribute_access_and_within_its_bounds():
    row = {"q": "two", "n": 7, "x": 0.125, "chat": [{"role": "user"}], "flag": True}
    text = render_template(f"{{q:>6}}|{{n:03d}}|{{x:.2f}}|{{chat}}|{{flag}}|{{{{q}}}}|{{q:>{MAX_TEMPLATE_WIDTH}}}", row)
    assert text == "   two|007|0.12|[{'role': 'user'}]|True|{q}|" + "two".rjust(MAX_TEMPLATE_WIDTH)
    for template, bad_row, reason in (
        ("{q:>4}", {"q": {"a": 1}}, "wrong_type"),
        ("{q:d}", {"q": "t"}, "wrong_type"),
        ("{q}", {}, "missing_key"),
        ("{q}", {"q": None}, "missing_key"),
        ("{q:c}", {"q": 10**30}, "wrong_type"),
    ):
        with pytest.raises(BadRow) as err:
            render_template(template, bad_row)
        assert err.value.reason == reason


@pytest.mark.parametrize("template", ["{question:{id.__class__}}", "{question:>1000000000}", "{question!r}"])
def test_flash_validate_refuses_the_template_in_one_line(tmp_path, capsys, template):
    from flash.app.cli import main

    path = write_lines(tmp_path / "d.jsonl", rows())
    override = [f"data.train=[{path}]", "data.sft_key=answer", f"data.template='{template}'"]
    assert main(["validate", "recipes/math.yaml", *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.template field" in err[0], err
    with pytest.raises(ValueError, match="data.template field"):
        make_task("dataset", train=(path,), template=template)  # refused at run too, before any row


@pytest.mark.parametrize(
    "template, bound",
    [
        ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "1,000,000 loop steps"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "over 33,554,432 characters",
        ),
    ],
)
def test_flash_validate_ends_a_chat_template_over_its_bounds_in_one_line(tmp_path, capsys, template, bound):
    """Such a template held `flash validate` for hours, or ended it in a MemoryError traceback."""
    from flash.app.cli import main

    (tmp_path / "t.jinja").write_text(template)
    path = write_lines(tmp_path / "d.jsonl", rows())
    override = [
        f"data.train=[{path}]",
        "data.sft_key=answer",
        "data.prompt_key=question",
        "data.system_prompt=brief",
        f"model.chat_template={tmp_path / 't.jinja'}",
    ]  # a chat: templated
    assert main(["validate", "recipes/math.yaml", *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.chat_template ({tmp_path / 't.jinja'}): the chat template" in err[0], err
    assert bound in err[0]


# ---- sizes and shapes of rows -------------------------------------------------------------------


def test_json_depth_leaves_out_brackets_inside_strings():
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert json_depth(b'{"a": "\\"[[[", "b": [[1]]}') == 3
    assert json_depth(b"[" * 5000 + b"]" * 5000) == 5000
    assert json_depth(b'{"a": [' + b"[1], " * 500 + b"[2]]}") == 3  # many lists, shallow
    assert json_depth(b"[" * 70 + b"]" * 70 + b"]" * 500) == 70  # a parser stops at the first unmatched closer


@pytest.mark.parametrize(
    "bad, reason",
    [
        (b'{"question": "q", "answer": "1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deep"),
        (b'{"question": "q", "answer": "1", "x": ' + b'{"k": ' * 5000 + b"1" + b"}" * 5000 + b"}", "too_deep"),
        (b'{"question": "q", "answer": "1", "x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "too_deep"),
        (json.dumps({"question": "q" * (MAX_ROW_BYTES + 10), "answer": "1"}).encode(), "too_large"),
        (b'{"question": "' + b"[" * (MAX_ROW_BYTES + 10), "too_large"),  # no newline, no end
    ],
)
def test_a_row_over_the_bounds_is_skipped_and_counted_before_arrow_reads_it(tmp_path, bad, reason):
    """A row thousands of levels deep ended the process inside Arrow's JSON reader (segfault)."""
    good = rows()
    last = bad.endswith(b"}")
    lines = good[:3] + [bad] + good[3:] if last else good + [bad]
    skipped = Counter()
    ds = open_rows([write_lines(tmp_path / "d.jsonl", lines)], skipped=skipped)
    assert len(ds) == len(good) and skipped == Counter({reason: 1})
    assert [r["id"] for r in ds] == [r["id"] for r in good]


def test_rows_within_the_bounds_are_all_read(tmp_path):
    deep_ok = {"question": "q", "answer": "1", "x": json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))}
    in_string = {"question": "[" * 10_000 + "{" * 10_000, "answer": "1", "x": [[0]] * 200}
    skipped = Counter()
    ds = open_rows([write_lines(tmp_path / "d.jsonl", [deep_ok, in_string])], skipped=skipped)
    assert len(ds) == 2 and not skipped


def test_a_one_document_json_too_deep_and_a_save_to_disk_arrow_file_that_does_not_read_are_one_line(tmp_path):
    doc = b'[{"question": "q", "answer": "1", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}]"
    (tmp_path / "d.json").write_bytes(doc)
    assert "write it as JSONL" in one_line_error(open_rows, [str(tmp_path / "d.json")])
    d = saved(tmp_path)
    (d / _arrow(d)).write_bytes(b"\xff" * 64)
    assert "cannot load the save_to_disk directory" in one_line_error(open_rows, [str(d)])


def test_skipped_rows_reach_flash_data_and_the_run_metrics(tmp_path):
    deep = b'{"question": "q", "answer": "1", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    path = write_lines(tmp_path / "d.jsonl", rows(20) + [deep, deep])
    task = make_task(
        "dataset", train=(path,), prompt_key="question", holdout=0, shuffle=False, reward="tests.reward_fns:exact"
    )
    assert task.read_skipped == Counter({"too_deep": 2}) and task.rows_per_epoch == 20
    assert scan(task, build_tokenizer(), 0, 5)["dropped"] == {"too_deep": 2}
    cfg = load_config("recipes/math.yaml", [f"data.train=[{path}]", "data.sft_key=answer", "data.prompt_key=question"])
    assert new_guards(cfg, 0, task.read_skipped).inputs.metrics() == {"data/skipped_too_deep": 2.0}
    strict = load_config(
        "recipes/math.yaml",
        [f"data.train=[{path}]", "data.sft_key=answer", "data.prompt_key=question", "data.strict=true"],
    )
    with pytest.raises(DataError, match="data.strict=false"):
        new_guards(strict, 0, task.read_skipped)


# ---- the math reference parser --------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, reason",
    [
        ("#### " + "(" * (MAX_PAREN_DEPTH + 1) + "1" + ")" * (MAX_PAREN_DEPTH + 1), "answer_too_deep"),
        ("$" + "[" * 40 + "2" + "]" * 40 + "$", "answer_too_deep"),
        ("\\left(" * 30 + "x" + "\\right)" * 30, "answer_too_deep"),
        ("#### " + "1+" * MAX_MATH_CHARS + "1", "answer_too_large"),
        ("x" * (5 << 20), "answer_too_large"),
        ("no number here", "bad_answer"),
    ],
)
def test_a_reference_over_the_bounds_is_a_bad_row_by_reason(tmp_path, answer, reason):
    """A short answer of nested parentheses held the driver for tens of seconds in math-verify."""
    path = write_lines(tmp_path / "d.jsonl", rows(3) + [{"question": "q?", "answer": answer, "id": 9}])
    task = make_task("dataset", train=(path,), prompt_key="question", holdout=0, shuffle=False)
    with pytest.raises(BadRow) as err:
        task.item(3)
    assert err.value.reason == reason and "\n" not in str(err.value)


def test_paren_depth_and_the_response_bound():
    texts = ("", "x", "(a)(b)", "((a)[b])", "))((", "f(g(h[x]))", ")" * 50 + "(" * 9 + ")" * 9)
    assert [paren_depth(t) for t in texts] == [0, 0, 1, 2, 2, 3, 9]  # leading closers hide nothing
    item = TaskItem(index=0, prompt="p", answer="#### 72")
    assert math_reward(item, "words " * 20_000 + "so the answer is \\boxed{72}") == 1.0  # its tail is parsed
    with pytest.raises(MathTooComplex) as err:
        math_reward(item, "$" + "(" * 12 + "72" + ")" * 12 + "$")
    assert err.value.reason == "too_deep"


@pytest.fixture(scope="module")
def checker():
    c = MathChecker(timeout_s=60.0)
    yield c
    c.close()


@pytest.mark.slow  # starts the child twice (a few seconds each)
def test_the_reference_check_has_a_deadline_and_goes_on_after_it(checker):
    assert checker.call("parse", "#### 72") is None
    assert checker.call("score", "#### 72", "it is \\boxed{72}") == 1.0
    with pytest.raises(ValueError, match="could not be parsed"):
        checker.call("parse", "no number here")
    checker.timeout_s = 0.05
    depth = MAX_PAREN_DEPTH  # within the bounds, still slow: the deadline ends it
    with pytest.raises(MathTooComplex) as err:
        checker.call("parse", "$" + "(" * depth + "1+1+1" + ")" * depth + "$")
    assert err.value.reason == "timeout" and checker.timeouts == 1
    checker.timeout_s = 60.0
    assert checker.call("parse", "#### 5") is None  # a fresh child serves the next call


# ---- data paths -----------------------------------------------------------------------------


def saved(tmp_path, name="s"):
    ds = datasets_module().Dataset.from_list(rows())
    ds.save_to_disk(str(tmp_path / name))
    return tmp_path / name


def _arrow(d):
    return next(f for f in os.listdir(d) if f.endswith(".arrow"))


def _replace_by_link(path, target):
    os.remove(path)
    os.symlink(target, path)


def _state(d, **change):
    state = json.loads((d / "state.json").read_text()) | change
    (d / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    "attack, words",
    [
        (lambda d, o: _replace_by_link(d / _arrow(d), o / _arrow(o)), "is a symlink"),
        (lambda d, o: os.symlink("/proc/self/environ", d / "extra.arrow"), "extra.arrow is a symlink"),
        (
            lambda d, o: (os.rename(d / "state.json", o / "st.json"), os.symlink(o / "st.json", d / "state.json")),
            "state.json is a symlink",
        ),
        (lambda d, o: os.symlink(o, d / "sub"), "sub is a symlink"),
        (lambda d, o: os.mkfifo(d / "pipe.arrow"), "pipe.arrow is not a regular file"),
        (lambda d, o: _state(d, _data_files=[{"filename": "../o/" + _arrow(o)}]), "not a plain name inside"),
        (lambda d, o: _state(d, _data_files=[{"filename": str(o / _arrow(o))}]), "not a plain name inside"),
        (lambda d, o: _state(d, _data_files=[{"filename": "x/../../o/" + _arrow(o)}]), "not a plain name inside"),
        (lambda d, o: _state(d, _data_files=[{"filename": 7}]), "not a plain name inside"),
        (lambda d, o: _state(d, _data_files=[]), "lists no data files"),
        (lambda d, o: _state(d, _data_files=[{"filename": "gone.arrow"}]), "gone.arrow is missing"),
        (lambda d, o: (d / "state.json").write_text("[" * 100_000 + "]" * 100_000), "not valid JSON"),
        (lambda d, o: os.truncate(d / "dataset_info.json", 17 << 20), "at most 16 MiB"),
    ],
)
def test_a_save_to_disk_directory_that_points_outside_itself_is_refused(tmp_path, attack, words):
    d, other = saved(tmp_path, "s"), saved(tmp_path, "o")
    attack(d, other)
    message = one_line_error(open_rows, [str(d)])
    assert words in message and "save_to_disk" in message


@pytest.mark.parametrize(
    "splits, words",
    [
        (["train", "../o"], "names split '../o'"),
        (["/etc", "train"], "names split '/etc'"),
        (["test"], "without a 'train' split"),
        ("train", "no 'splits' list"),
    ],
)
def test_a_dataset_dict_naming_splits_outside_itself_is_refused(tmp_path, splits, words):
    ds = datasets_module()
    ds.DatasetDict({"train": ds.Dataset.from_list(rows())}).save_to_disk(str(tmp_path / "dd"))
    assert len(open_rows([str(tmp_path / "dd")])) == 6
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    assert words in one_line_error(open_rows, [str(tmp_path / "dd")])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: os.symlink("/dev/zero", p), "not a regular file"),
        (lambda p: os.symlink("/proc/self/environ", p), "not a data file"),
        (lambda p: os.symlink("/proc/self/status", p), "not a data file"),
    ],
)
def test_a_named_data_file_that_is_not_a_regular_file_is_refused_without_opening_it(tmp_path, make, words):
    for suffix in (".jsonl", ".csv", ".parquet"):
        path = tmp_path / f"d{suffix}"
        make(path)
        assert words in one_line_error(open_rows, [str(path)])
        os.remove(path)


def test_a_file_of_only_rows_over_the_bounds_is_one_line(tmp_path):
    deep = b'{"question": "q", "answer": "1", "x": ' + b"[" * 200 + b"]" * 200 + b"}"
    message = one_line_error(open_rows, [write_lines(tmp_path / "d.jsonl", [deep, deep])])
    assert "every row of" in message and "'too_deep': 2" in message
