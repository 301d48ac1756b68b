"""The dataset task (flash.data): local files through HF datasets, rows as prompts, epochs, bad
rows, chat templates and per-row rewards. (The `flash data` verbs and eval sets: test_data_verbs.py.)"""

import json

import pytest

from flash.app.config import load_config
from flash.app.data import build_task, check_prompt_format, data_steps
from flash.data.files import datasets_module
from flash.data.rows import BadRow
from flash.errors import ConfigError
from flash.guards import DataError, InputGuard
from flash.models import build_tokenizer, encode_prompt
from tests.helpers.rows import dataset, gsm_rows, write_jsonl

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}assistant:"


def test_jsonl_parquet_csv_and_save_to_disk_give_identical_items(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", gsm_rows())
    ds = datasets_module().Dataset.from_list(gsm_rows())
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.to_csv(str(tmp_path / "a.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "a_dir"))
    opts = dict(prompt_key="question", holdout=3, sft_key="solution")
    tasks = [dataset(p, **opts) for p in (src, tmp_path / "a.parquet", tmp_path / "a.csv", tmp_path / "a_dir")]
    tok = build_tokenizer()
    want = [(tasks[0].item(i).prompt, tasks[0].item(i).answer) for i in range(50)]
    assert len(set(p for p, _ in want)) == 27  # 27 train rows (3 held out), two epochs
    for task in tasks[1:]:
        assert [(task.item(i).prompt, task.item(i).answer) for i in range(50)] == want
        assert [encode_prompt(tok, task.item(i).prompt) for i in range(5)] == [
            encode_prompt(tok, p) for p, _ in want[:5]
        ]
        assert task.data_fingerprint != tasks[0].data_fingerprint or task is tasks[0]
    # the warm-start cache key follows the bytes, not the path
    (tmp_path / "copy").mkdir()
    copy = write_jsonl(tmp_path / "copy" / "a.jsonl", gsm_rows())
    assert dataset(copy, **opts).data_fingerprint == tasks[0].data_fingerprint


def test_the_answer_column_is_the_demonstration_when_sft_key_names_it(tmp_path):
    """GSM8K's answers are worked solutions: ``data.sft_key`` equal to ``data.answer_key`` warm-starts on
    that column's text, the same text the reward reads as the reference."""
    rows = gsm_rows(12)
    task = dataset(
        write_jsonl(tmp_path / "gsm.jsonl", rows), prompt_key="question", sft_key="answer", holdout=0, shuffle=False
    )
    for i in range(15):  # past the end of the first epoch
        row = rows[i % 12]
        assert task.sft_pair(i) == (task.item(i).prompt, row["answer"]) == (row["question"], row["answer"])
    assert task.sft_pair(1)[1] == "1+2=3\n#### 3"
    # through the config (whose checks name every column), the run's task gives the same pairs
    cfg = load_config(
        "recipes/math.yaml",
        [
            f"data.train=[{tmp_path}/gsm.jsonl]",
            "data.prompt_key=question",
            "data.sft_key=answer",
            "data.holdout=0",
            "data.shuffle=false",
        ],
    )
    assert build_task(cfg).sft_pair(4) == (rows[4]["question"], rows[4]["answer"])


def test_each_epoch_is_a_seeded_permutation_of_the_train_rows_and_held_out_rows_are_never_trained(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", gsm_rows())
    task = dataset(path, prompt_key="question", holdout=64, seed=3)
    n = task.rows_per_epoch
    assert n == 27  # at most a tenth held out
    held = {task.item(i, "eval").meta["row"] for i in range(3)}
    assert len(held) == 3
    epochs = [[task.item(e * n + i).meta["row"] for i in range(n)] for e in range(3)]
    for rows in epochs:
        assert sorted(rows) == sorted(set(range(30)) - held)  # every train row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
    assert [dataset(path, prompt_key="question", holdout=64, seed=3).position(i) for i in range(2 * n)] == [
        task.position(i) for i in range(2 * n)
    ]  # the same seed, the same stream
    assert [dataset(path, prompt_key="question", holdout=64, seed=4).position(i) for i in range(n)] != [
        task.position(i) for i in range(n)
    ]
    fixed = dataset(path, prompt_key="question", holdout=0, shuffle=False)
    assert [fixed.item(i).meta["row"] for i in range(35)] == list(range(30)) + list(range(5))


def test_epochs_end_the_run_before_train_steps_when_they_come_first(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", gsm_rows())
    cfg = load_config(
        "recipes/math.yaml",
        [
            f"data.train=[{path}]",
            "data.prompt_key=question",
            "data.sft_key=solution",
            "data.holdout=3",
            "data.epochs=2",
            "train.prompts_per_step=4",
            "train.steps=100",
        ],
    )
    assert data_steps(cfg, build_task(cfg)) == 13  # 2 epochs x 27 rows / 4 per step
    cfg.train.steps = 5
    assert data_steps(cfg, build_task(cfg)) == 5


def test_bad_rows_are_skipped_and_counted_per_reason_or_stop_the_run_when_strict(tmp_path):
    good = gsm_rows(4)
    bad = [
        {"question": "", "answer": "1", "solution": "1"},  # empty
        {"question": None, "answer": "1", "solution": "1"},  # missing_key (null)
        {"question": 7, "answer": "1", "solution": "1"},  # wrong_type
        {"question": "what is it?", "answer": "no number at all", "solution": "1"},  # bad_answer
        {"question": "x" * 300, "answer": "2", "solution": "2"},
    ]  # too_long
    path = write_jsonl(tmp_path / "a.jsonl", good[:2] + bad + good[2:])
    task = dataset(path, prompt_key="question", holdout=0, shuffle=False)
    tok = build_tokenizer()
    guard = InputGuard(max_prompt_tokens=200, warn=lambda _: None)
    taken = []
    index = 0
    while index < task.rows_per_epoch:
        index, item, _ = guard.take(index, task.item, lambda p: encode_prompt(tok, p))
        if index < task.rows_per_epoch:
            taken.append(item.meta["row"])
        index += 1
    assert taken == [0, 1, 7, 8]
    assert guard.metrics() == {
        "data/skipped_bad_answer": 1.0,
        "data/skipped_empty": 1.0,
        "data/skipped_missing_key": 1.0,
        "data/skipped_too_long": 1.0,
        "data/skipped_wrong_type": 1.0,
    }
    strict = InputGuard(max_prompt_tokens=200, strict=True, warn=lambda _: None)
    with pytest.raises(DataError, match="data index 2 is empty"):
        strict.take(2, task.item, lambda p: encode_prompt(tok, p))
    all_bad = dataset(write_jsonl(tmp_path / "b.jsonl", bad[:1]), prompt_key="question", holdout=0)
    with pytest.raises(DataError, match="no usable prompt"):
        InputGuard(max_prompt_tokens=200, max_consecutive=50, warn=lambda _: None).take(
            0, all_bad.item, lambda p: encode_prompt(tok, p)
        )


BAD_SOURCES = {
    "{tmp}/nope.jsonl": "no such file or directory",
    "openai/gsm8k": "download it first",
    "{tmp}/a.jsonl data.prompt_key=questoin": "has no column 'questoin'; did you mean 'question'?",
    "{tmp}/a.txt": "unknown file type '.txt'",
}


@pytest.mark.parametrize("source", BAD_SOURCES)
def test_a_missing_file_a_hub_name_and_a_missing_column_are_one_line_errors(tmp_path, source):
    write_jsonl(tmp_path / "a.jsonl", gsm_rows())
    (tmp_path / "a.txt").write_text("x")
    train, *rest = source.format(tmp=tmp_path).split()
    message = BAD_SOURCES[source]
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("(", r"\(")) as err:
        load_config("recipes/math.yaml", [f"data.train=[{train}]", *rest, "data.sft_key=solution"])
    assert "\n" not in str(err.value)


def test_a_template_names_plain_columns_and_sft_needs_its_key(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", gsm_rows())
    base = ["data.sft_key=solution"]
    with pytest.raises(ConfigError, match="plain column name"):
        load_config("recipes/math.yaml", [f"data.train=[{path}]", *base, "data.template='{question.__class__}'"])
    with pytest.raises(ConfigError, match="data.sft_key"):
        load_config("recipes/math.yaml", [f"data.train=[{path}]", "data.prompt_key=question"])
    load_config("recipes/math.yaml", [f"data.train=[{path}]", "data.prompt_key=question", *base])


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", broken\n', "in row 1; fix the file"),
        (bytes(range(128, 256)), "JSON parse error"),
        (b"", "is empty: a data file needs at least one row"),
    ],
)
def test_a_broken_or_empty_file_is_one_line_that_says_what_is_wrong(tmp_path, capsys, content, message):
    """datasets' own error said only 'An error occurred while generating the dataset' (an empty file:
    'StopIteration: '), after a log line of its own."""
    from flash.app.cli import main

    (tmp_path / "d.jsonl").write_bytes(content)
    override = [f"data.train=[{tmp_path}/d.jsonl]", "data.sft_key=answer", "data.prompt_key=question"]
    with pytest.raises(ConfigError, match=message) as err:
        load_config("recipes/math.yaml", override)
    assert "\n" not in str(err.value)
    capsys.readouterr()
    assert main(["validate", "recipes/math.yaml", *override]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and not captured.out


def test_chat_prompts_are_tokenized_exactly_as_apply_chat_template(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"add {a} and {a + 1}."}], "answer": str(2 * a + 1)}
        for a in range(1, 9)
    ]
    rows[0]["messages"] = [{"role": "system", "content": "be brief."}, *rows[0]["messages"]]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    for template, system in ((CHATML, None), (PLAIN, "answer with a number.")):
        tok = build_tokenizer(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 .:|<>_\t{}'")
        tok.chat_template = template
        task = dataset(path, prompt_key="messages", holdout=0, shuffle=False, system_prompt=system)
        for i in range(8):
            messages = task.item(i).prompt
            assert isinstance(messages, list)
            want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            assert encode_prompt(tok, messages) == want
            first = "be brief." if i == 0 else system  # the row's own system turn, else system_prompt
            assert (messages[0]["role"], messages[0]["content"]) == (
                ("system", first) if first else ("user", f"add {i + 1} and {i + 2}.")
            )
    no_template = build_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="model.chat_template"):
        encode_prompt(no_template, task.item(0).prompt)
    tiny = build_tokenizer()  # the CPU model's own template
    assert tiny.decode(encode_prompt(tiny, task.item(1).prompt)) == (
        "<bos><|system|>answer with a number.<eos><|user|>add 2 and 3.<eos><|assistant|>"
    )


def test_model_chat_template_from_a_file_and_the_check_before_any_row_is_skipped(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "add 1 and 2."}], "answer": "3"}] * 3
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    (tmp_path / "t.jinja").write_text(PLAIN)
    over = [f"data.train=[{path}]", "data.prompt_key=messages", "data.holdout=0", "sft.steps=0"]
    cfg = load_config("recipes/math.yaml", over)
    task = build_task(cfg)
    no_template = build_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ConfigError, match="model.chat_template"):
        check_prompt_format(cfg, task, no_template)
    check_prompt_format(cfg, task, build_tokenizer())  # the CPU model's tokenizer reads chats
    cfg = load_config("recipes/math.yaml", [*over, f"model.chat_template={tmp_path}/t.jinja"])
    from flash.app.data_preview import preview_tokenizer

    tok = preview_tokenizer(cfg)
    check_prompt_format(cfg, task, tok)
    assert tok.decode(encode_prompt(tok, task.item(0).prompt)) == "user: add 1 and 2. | assistant:"


def test_template_and_system_prompt_shape_text_rows(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", gsm_rows(3))
    task = dataset(path, template="q: {question} ({id})", holdout=0, shuffle=False)
    assert task.item(0).prompt == "q: tom has 1 apples and buys 1 more. how many apples now? (11)"
    chat = dataset(path, prompt_key="question", system_prompt="be brief.", holdout=0, shuffle=False)
    assert chat.item(1).prompt == [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "tom has 1 apples and buys 2 more. how many apples now?"},
    ]
    assert chat.item(1).meta["id"] == 12 and chat.item(1).meta["solution"] == "1+2=3"  # columns travel


def test_rewards_route_per_row_and_read_gsm8k_references(tmp_path):
    rows = [
        {"q": "add.", "answer": "3+4=7\n#### 7", "kind": "math"},
        {"q": "say hi.", "answer": "hi", "kind": "exact"},
        {
            "q": "write f.",
            "answer": "",
            "kind": "code",
            "tests": json.dumps(["assert f(1) == 2", "assert f(5) == 6", "assert f(0) == 0"]),
        },
    ]
    task = dataset(
        write_jsonl(tmp_path / "r.jsonl", rows),
        prompt_key="q",
        reward_key="kind",
        holdout=0,
        shuffle=False,
        rewards={"exact": "tests.reward_fns:exact"},
    )
    math_item, exact_item, code_item = (task.item(i) for i in range(3))
    assert task.reward(math_item, "the answer is \\boxed{7}") == 1.0
    assert task.reward(math_item, "#### 8") == 0.0
    assert task.reward(exact_item, "hi") == 1.0 and task.reward(exact_item, "7") == 0.0  # not math
    assert task.reward(code_item, "```python\ndef f(x):\n    return x + 1\n```") == pytest.approx(2 / 3)
    bad = dataset(
        write_jsonl(tmp_path / "b.jsonl", [{"q": "a", "answer": "3", "kind": 5}]),
        prompt_key="q",
        reward_key="kind",
        holdout=0,
    )
    with pytest.raises(BadRow, match="must name a reward") as err:
        bad.item(0)
    assert err.value.reason == "wrong_type"


def test_a_row_reward_that_returns_a_reward_result_scores_its_number(tmp_path):
    rows = [{"q": "say hi.", "answer": "hi", "kind": "tests.reward_fns:exact_result"}]
    task = dataset(
        write_jsonl(tmp_path / "r.jsonl", rows),
        prompt_key="q",
        reward_key="kind",
        holdout=0,
        rewards={"exact": "tests.reward_fns:exact_result"},
    )  # a listed path may be named as itself
    item = task.item(0)
    assert task.reward(item, "hi") == 1.0 and task.reward(item, "no") == 0.0
    assert float(task.reward(item, "hi")) == 1.0  # the scheduler's float(): a RewardResult would score 0


def test_answers_of_any_json_type_reach_the_reward_as_their_json_text(tmp_path):
    rows = [
        {"q": "is 2 even?", "answer": True},
        {"q": "is 3 even?", "answer": False},
        {"q": "roots?", "answer": [1, 2]},
        {"q": "name?", "answer": "ada"},
    ]
    task = dataset(
        write_jsonl(tmp_path / "a.jsonl", rows),
        prompt_key="q",
        holdout=0,
        shuffle=False,
        reward="tests.reward_fns:exact",
    )
    assert [task.item(i).answer for i in range(4)] == ["true", "false", "[1, 2]", "ada"]  # as the file has them


def test_columns_flash_replaces_are_named_and_a_reward_fn_column_never_picks_the_reward(tmp_path, caplog):
    rows = [{"q": "1+1?", "answer": "2", "split": "dev", "reward_fn": "tests.reward_fns:response_length", "level": 3}]
    task = dataset(
        write_jsonl(tmp_path / "c.jsonl", rows),
        prompt_key="q",
        holdout=0,
        shuffle=False,
        reward="tests.reward_fns:exact",
    )
    assert "column(s) reward_fn, split are replaced in item.meta by flash's own" in caplog.text
    item = task.item(0)
    assert item.meta["split"] == "train" and item.meta["level"] == 3 and "reward_fn" not in item.meta
    assert task.reward(item, "3") == 0.0 and task.reward(item, "2") == 1.0  # the recipe's reward, not the column's


def test_the_same_rows_in_three_formats_give_identical_first_step_losses(tmp_path):
    """The textbook synchronous loop (tests.helpers.inproc) over each file: same samples, same loss."""
    from tests.helpers.inproc import plain_sync_loop
    from tests.helpers.models import TINY, save_tiny

    from flash.app.data import load_tokenizer

    ds = datasets_module().Dataset.from_list(gsm_rows())
    paths = [write_jsonl(tmp_path / "a.jsonl", gsm_rows()), str(tmp_path / "a.parquet"), str(tmp_path / "a_dir")]
    ds.to_parquet(paths[1])
    ds.save_to_disk(paths[2])
    model = save_tiny(tmp_path / "model", TINY)
    results = []
    for path in paths:
        cfg = load_config(
            "recipes/math.yaml",
            [
                f"data.train=[{path}]",
                "data.prompt_key=question",
                f"model.path={model}",
                "train.prompts_per_step=4",
                "rollout.n=4",
                "data.reward=tests.reward_fns:response_length",
                "reward.fn={}",
            ],
        )
        results.append(plain_sync_loop(cfg, model, build_task(cfg), load_tokenizer(cfg, model), steps=1))
    ((samples, loss),) = results[0]
    assert len(samples) == 16 and loss != 0.0
    assert results[1] == results[0] and results[2] == results[0]


def test_a_reward_fn_owns_the_rows_so_their_references_are_not_checked_as_math(tmp_path):
    rows = [{"question": f"write f{i}.", "answer": "no number at all", "solution": "x"} for i in range(3)]
    path = write_jsonl(tmp_path / "he.jsonl", rows)
    common = [f"data.train=[{path}]", "data.prompt_key=question", "data.holdout=0", "data.sft_key=solution"]
    cfg = load_config("recipes/math.yaml", [*common, "reward.fn.name=tests.reward_fns:exact"])
    task = build_task(cfg)
    assert [task.item(i).answer for i in range(3)] == ["no number at all"] * 3  # math's bad_answer
    assert task.options.reward == "tests.reward_fns:exact"
    assert build_task(load_config("recipes/math.yaml", common)).options.reward == "math"  # checked as math
