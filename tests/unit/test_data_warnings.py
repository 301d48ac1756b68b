"""Warnings before a run wastes itself (flash.app.data_warnings): responses longer than the cap,
every row dropped, rows naming a reward the recipe does not allow, every reference scored 0 by the
run's reward; one line each, naming the fix,
from `flash validate` and `flash data`."""

import json
import sys

from flash.app.cli import main
from flash.app.data_warnings import dropped_warning, length_warning, reference_warning


def test_each_warning_is_one_line_with_the_numbers_and_the_fix():
    assert length_warning("references", [3, 5, 8], 8) is None
    line = length_warning("demonstrations", [3, 12, 9, 8], 8)
    assert line.startswith("2 of 4 demonstrations are longer than rollout.max_new_tokens=8 (longest 12 tokens)")
    assert "set rollout.max_new_tokens=12" in line and "\n" not in line
    assert dropped_warning(10, 1, [(0, "empty")]) is None and dropped_warning(0, 0, []) is None
    line = dropped_warning(4, 0, [(0, "empty"), (1, "malformed: KeyError: 'q'"), (2, "empty"), (3, "empty")])
    assert (
        "every one of the first 4 rows is dropped (row 0: empty; row 1: malformed: KeyError: 'q'; row 2: empty)" in line
    )
    assert reference_warning([0.0, 1.0]) is None and reference_warning([]) is None
    assert reference_warning([0.0, 0.5]) is None
    line = reference_warning([0.0, "error: KeyError: 'x'", 0.0])
    assert line.startswith("the reward scores every one of 3 references 0") and "e.g. error: KeyError: 'x'" in line


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GSM = [
    {
        "question": f"tom has {a} apples and buys {b} more. how many apples now?",
        "answer": f"{a}+{b}={a + b}\n#### {a + b}",
    }
    for a in range(1, 7)
    for b in range(1, 6)
]


def _validate(capsys, *over):
    assert main(["validate", "math", *over]) == 0
    return [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning: ")]


def test_validate_warns_of_demonstrations_longer_than_the_cap_once_when_they_are_the_references(tmp_path, capsys):
    data = [f"data.train=[{_rows(tmp_path / 'gsm.jsonl', GSM)}]", "data.prompt_key=question", "data.sft_key=answer"]
    lines = _validate(capsys, *data, "rollout.max_new_tokens=8")
    assert lines == [
        "warning: 27 of 27 demonstrations (the references) are longer than rollout.max_new_tokens=8 "
        "(longest 15 tokens): responses like them are cut at 8 tokens and score 0; set "
        "rollout.max_new_tokens=15 or shorten them"
    ], lines
    assert _validate(capsys, *data, "rollout.max_new_tokens=15") == []
    assert _validate(capsys) == []  # the shipped recipe: nothing to say


def test_validate_warns_when_every_row_is_dropped_with_each_row_s_reason(tmp_path, capsys):
    rows = [{"question": r["question"], "answer": "seven"} for r in GSM]
    lines = _validate(
        capsys,
        f"data.train=[{_rows(tmp_path / 'bad.jsonl', rows)}]",
        "data.prompt_key=question",
        "data.sft_key=answer",
        "rollout.max_new_tokens=16",
    )
    assert len(lines) == 1 and lines[0].startswith(
        "warning: every one of the first 27 rows is dropped (row 0: bad_answer: "
    ), lines
    # flash data counts each row once (not the guard's run of 10,000 past the file's end) and shows why
    assert (
        main(
            [
                "data",
                "math",
                f"data.train=[{tmp_path / 'bad.jsonl'}]",
                "data.prompt_key=question",
                "data.sft_key=answer",
                "rollout.max_new_tokens=16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "dropped: {'bad_answer': 27}" in out and "  data index 0: bad_answer: BadRow: reference answer 'seven'" in out
    )


def test_validate_and_data_warn_when_the_run_s_reward_scores_every_reference_zero(tmp_path, capsys, monkeypatch):
    (tmp_path / "zero_reward.py").write_text("def score(item, response):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = [
        f"data.train=[{_rows(tmp_path / 'gsm.jsonl', GSM)}]",
        "data.prompt_key=question",
        "data.sft_key=answer",
        "rollout.max_new_tokens=16",
    ]
    lines = _validate(capsys, *data, "reward.fn={name: 'zero_reward:score'}")
    assert lines == [
        "warning: the reward scores every one of 16 references 0 when the reference itself is the "
        "response: nothing can earn a reward; check data.answer_key / data.reward (or reward.fn) "
        "against the answer format"
    ], lines
    assert main(["data", "math", *data, "reward.fn={name: 'zero_reward:score'}"]) == 0
    assert "warning: the reward scores every one of 16 references 0" in capsys.readouterr().out
    sys.modules.pop("zero_reward", None)


def test_validate_warns_of_rows_naming_a_reward_the_recipe_does_not_allow_with_the_closest_name(tmp_path, capsys):
    rows = [{**r, "kind": "mth" if i % 3 == 0 else "math"} for i, r in enumerate(GSM)]
    lines = _validate(
        capsys,
        f"data.train=[{_rows(tmp_path / 'kinds.jsonl', rows)}]",
        "data.prompt_key=question",
        "data.sft_key=answer",
        "data.reward_key=kind",
        "reward.fn={}",
        "rollout.max_new_tokens=16",
    )
    assert len(lines) == 1 and lines[0].startswith(
        "warning: 9 of the first 27 rows name a reward the recipe does not "
        "allow and would be skipped (data/skipped_bad_reward_name), never "
        "trained; data index "
    ), lines
    assert lines[0].endswith(
        ": column 'kind' names reward 'mth', which the recipe does not list (a row may name code, "
        "judge, math): did you mean 'math'? list it in data.rewards to allow it"
    ), lines


def test_the_rewards_page_describes_every_field_of_the_item_a_reward_gets(tmp_path):
    from pathlib import Path

    from flash.data.rows import OWN_META
    from flash.tasks import TaskItem
    from flash.recipes.tasks import make_task

    page = Path(__file__).parents[2].joinpath("docs/rewards.md").read_text()
    path = _rows(tmp_path / "rows.jsonl", [{"question": "what is 1+1?", "answer": 2, "tests": "[]"}] * 4)
    item = make_task("dataset", train=(path,), prompt_key="question", holdout=0).item(1)
    assert item.answer == "2" and item.meta["tests"] == "[]"
    assert set(OWN_META) - {"reward_fn"} <= set(item.meta)
    for name in [*TaskItem.__dataclass_fields__, *OWN_META]:
        assert f"`{name}`" in page or f"`item.{name}`" in page, name
