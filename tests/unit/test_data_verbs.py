"""The `flash data` verbs and evaluation sets: export writes a task's rows to a file that trains the
same items, preview shows prompts, drops and references that score zero, eval sets are files or
built-in tasks, and pass@k is the unbiased estimator."""

import json

import pytest

from flash.app.config import load_config
from flash.app.data_preview import export_task, histogram, preview
from flash.errors import ConfigError
from flash.recipes.tasks import make_task
from tests.helpers.rows import dataset, gsm_rows, write_jsonl


def test_export_writes_a_builtin_task_that_trains_the_same_items_from_a_file(tmp_path):
    from flash.recipes.tasks import make_task as make

    for name in ("out.jsonl", "out.parquet", "out_dir"):
        assert export_task("wordproblems", {"seed": 2}, str(tmp_path / name), rows=40) == 40
        task = dataset(tmp_path / name, holdout=0, shuffle=False, sft_key="solution")
        source = make("wordproblems", seed=2)
        for i in range(40):
            assert task.item(i).prompt == source.item(i).prompt
            assert task.item(i).answer == source.item(i).answer
            assert task.sft_pair(i) == source.sft_pair(i)
            assert task.item(i).meta["op"] == source.item(i).meta["op"]


def test_export_writes_a_column_arrow_cannot_type_as_json_text(tmp_path, caplog):
    from flash.recipes.tasks import make_task as make

    assert export_task("pyfunc", {"seed": 1}, str(tmp_path / "p.parquet"), rows=12) == 12
    assert "column(s) chain mix types Arrow cannot hold in one column; written as JSON text" in caplog.text
    task, source = dataset(tmp_path / "p.parquet", holdout=0, shuffle=False, reward="code"), make("pyfunc", seed=1)
    for i in range(12):
        got, want = task.item(i).meta, source.item(i).meta
        assert got["tests"] == want["tests"] and json.loads(got["chain"]) == want["chain"]


def test_preview_shows_prompts_lengths_drops_and_references_that_score_zero(tmp_path):
    rows = gsm_rows(10) + [{"question": "", "answer": "1", "solution": "1", "id": 0}]
    rows[3]["answer"] = " 4"  # `exact` strips the response, not the reference: its own answer scores 0
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    cfg = load_config(
        "recipes/math.yaml",
        [
            f"data.train=[{path}]",
            "data.prompt_key=question",
            "data.sft_key=solution",
            "data.holdout=0",
            "data.shuffle=false",
            "data.reward=tests.reward_fns:exact",
            "reward.fn={}",
        ],
    )
    lines = []
    result = preview(cfg, rows=100, out=lines.append)
    text = "\n".join(lines)
    assert result["dropped"] == {"empty": 1}
    assert len(result["kept"]) == 10
    assert text.startswith("--- data index 0 (") and "<bos>tom has 1 apples" in text
    assert [item.meta["row"] for item, _, r in result["kept"] if r == 0.0] == [3]
    assert "references scoring 0 (a data or reward bug): 1 of 10" in text
    assert "data index 3: answer ' 4' -> 0.0" in text
    assert sum(n for _, _, n in histogram([len(ids) for _, ids, _ in result["kept"]])) == 10


def test_pass_at_k_is_the_unbiased_estimator():
    from flash.app.evaluation import ks, pass_at_k, set_metrics

    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert ks(1) == [1] and ks(4) == [1, 2, 4] and ks(6) == [1, 2, 4, 6]
    m = set_metrics("dev", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]], [3, 4, 5, 6, 7, 8, 9, 10])
    assert m["eval/dev/mean@4"] == pytest.approx(3 / 8)  # 0.5 is not solved
    assert m["eval/dev/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["eval/dev/pass@4"] == 1.0 and m["eval/dev/pass@1"] == pytest.approx(3 / 8)
    assert m["eval/dev/reward_mean"] == pytest.approx(3.5 / 8) and m["eval/dev/response_tokens"] == 6.5


def test_eval_sets_are_files_or_builtin_tasks_and_a_bad_one_is_a_one_line_error(tmp_path):
    from flash.app.evaluation import build_eval_sets

    path = write_jsonl(tmp_path / "dev.jsonl", gsm_rows(12))
    cfg = load_config(
        "recipes/math.yaml",
        [f"eval.sets={{dev: {path}, words: {{task: wordproblems, eval_size: 5}}}}", "data.prompt_key=question"],
    )
    sets = {s.name: s for s in build_eval_sets(cfg)}
    assert len(sets["dev"].items) == 12 and len(sets["words"].items) == 5
    assert sets["dev"].items[3].prompt == gsm_rows(12)[3]["question"]  # file order, nothing held out
    assert sets["dev"].rescore is None  # reward.fn is set: the reward workers score every set
    cfg = load_config("recipes/stutter.yaml", [f"eval.sets={{dev: {path}}}", "data.prompt_key=question"])
    dev = build_eval_sets(cfg)[0]
    assert dev.rescore(dev.items[0], "#### 2") == 1.0 and dev.rescore(dev.items[0], "3") == 0.0  # its own: math
    with pytest.raises(ConfigError, match="eval.sets.dev: .*no such file"):
        load_config("recipes/math.yaml", [f"eval.sets={{dev: {tmp_path}/nope.jsonl}}"])
    with pytest.raises(ConfigError, match="eval.sets.x must be a file"):
        load_config("recipes/math.yaml", ["eval.sets={x: 3}"])


def test_the_flash_data_verbs_export_and_preview_from_the_command_line(tmp_path, capsys):
    from flash.app.cli import main

    out = tmp_path / "wp.csv"
    assert main(["data", "export", "wordproblems", "seed=5", "max_operand=3", "-o", str(out), "--rows", "12"]) == 0
    assert "wrote 12 train rows of wordproblems" in capsys.readouterr().out
    task = dataset(out, holdout=0, shuffle=False)
    assert task.item(4).prompt == make_task("wordproblems", seed=5, max_operand=3).item(4).prompt
    assert main(["data", "recipes/math.yaml", f"data.train=[{out}]", "data.sft_key=solution"]) == 0
    text = capsys.readouterr().out
    assert (
        "--- data index 0 (" in text and "references scoring 0 (a data or reward bug): 0 of 11" in text
    )  # one row held out
    assert main(["data", "export", "wordproblems", "max_operand=1", "-o", str(out)]) == 2
    assert "max_operand must be in [2, 99]" in capsys.readouterr().err
    assert main(["data", "export", "wordproblems", "-o", str(tmp_path / "x.txt")]) == 2
