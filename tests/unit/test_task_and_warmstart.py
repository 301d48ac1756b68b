"""Task registry and items, the byte tokenizer, the tiny model, and the cached SFT warm start.

Fast: the warm-start tests train a one-layer model for a few steps.
"""

import dataclasses
import json
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flash.models import (
    DEFAULT_ALPHABET,
    ROLE_TOKENS,
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    decode_response,
    encode_prompt,
    encode_response,
)
from flash.train.sft import META_FILE, SFTConfig, cache_key, sft_batch, task_tokenizer, warm_start
from flash.recipes.tasks import make_task, registered_tasks, task_options
from flash.tasks import Task, TaskItem, register_task
from flash.recipes.tasks.chainsum import ChainSumOptions, running_sums
from flash.recipes.tasks.echo import slip

SMALL_MODEL = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=128
)
SMALL_SFT = SFTConfig(steps=3, batch_size=4, pool_batches=2, warmup_steps=1)


# ---------------------------------------------------------------- registry and options


def test_registry_and_unknown_options_name_the_closest():
    assert {"chainsum", "echo", "stutter"} <= set(registered_tasks())
    assert task_options("chainsum") is ChainSumOptions
    with pytest.raises(ValueError, match="did you mean 'slip_prob'"):
        make_task("chainsum", slip_prb=0.1)
    with pytest.raises(ValueError, match="did you mean 'chainsum'"):
        make_task("chainsun")
    with pytest.raises(ValueError):  # options validate their values too
        make_task("chainsum", max_terms=99)


def test_register_task_rejects_a_second_class_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):

        @register_task("chainsum")
        class Other(Task):  # noqa: F841
            Options = ChainSumOptions


# ---------------------------------------------------------------- items and rewards


def test_items_are_deterministic_and_the_splits_are_separate_streams():
    task = make_task("chainsum")
    assert task.item(5) == task.item(5) == make_task("chainsum").item(5)
    assert task.item(5, "eval") == task.item(5, "eval")
    train = [task.item(i).prompt for i in range(300)]
    evals = [task.item(i, "eval").prompt for i in range(300)]
    assert train != evals
    long_common = {p for p in set(train) & set(evals) if p.count(" ") >= 3}
    assert len(long_common) <= 1  # only items of <= 3 terms (1110 prompts) coincide often
    assert make_task("chainsum", seed=1).item(5) != task.item(5)
    assert len(task.eval_items()) == 256
    assert len(make_task("chainsum", eval_size=8).eval_items()) == 8
    with pytest.raises(ValueError):
        task.item(0, "test")


def test_chainsum_format_and_reward_on_hand_written_cases():
    task = make_task("chainsum")
    item = TaskItem(index=0, prompt="a3 b5 c2 d8:", answer="8", meta={"digits": [3, 5, 2, 8]})
    assert running_sums([3, 5, 2, 8]) == [3, 8, 0, 8]
    assert task.reward(item, "a3 b8 c0 d8 =8") == 1.0
    assert task.reward(item, "a3 b8 c0 d8 = 8 ") == 1.0  # the answer after the last '='
    assert task.reward(item, "a3 b9 c1 d9 =9") == 0.0  # a slip carried to the end
    assert task.reward(item, "a3 b8 c0 d8") == 0.0  # no answer
    assert task.reward(item, "") == 0.0
    real = task.item(3)
    assert task.reward(real, task.solution(real)) == 1.0
    longest = max(len(task.solution(task.item(i))) + 1 for i in range(500))
    assert task.max_response_tokens() >= longest


def test_chainsum_sft_noise_is_structured_and_seeded():
    clean, noisy = make_task("chainsum", slip_prob=0.0), make_task("chainsum", slip_prob=0.5)
    for i in range(20):
        assert clean.sft_pair(i) == (clean.item(i).prompt, clean.solution(clean.item(i)))
    assert noisy.sft_pair(7) == noisy.sft_pair(7)
    assert sum(noisy.sft_pair(i) != clean.sft_pair(i) for i in range(200)) > 100


@pytest.mark.parametrize("name", ["chainsum", "echo"])
def test_response_lengths_have_a_long_tail(name):
    task = make_task(name)
    solve = task.solution if name == "chainsum" else (lambda item: item.answer)
    lengths = sorted(len(solve(task.item(i))) + 1 for i in range(2000))
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 >= 3 * median and lengths[-1] <= task.max_response_tokens()


def test_echo_items_and_reward_on_hand_written_cases():
    task = make_task("echo", width=8)
    item = TaskItem(index=0, prompt="qdkx....:", answer="qdkx")
    assert task.reward(item, "qdkx") == 1.0 and task.reward(item, " qdkx ") == 1.0
    assert task.reward(item, "qdky") == 0.0  # one slip
    assert task.reward(item, "qdk") == 0.0 and task.reward(item, "qdkxx") == 0.0
    assert task.reward(item, "") == 0.0
    real = task.item(11)
    assert real.prompt == real.answer.ljust(8, ".") + ":" and real.meta["length"] == len(real.answer)
    assert all(len(task.item(i).prompt) == 9 for i in range(200))  # a fixed-width field
    assert task.max_response_tokens() == 9
    with pytest.raises(ValueError, match="did you mean 'mean_len'"):
        make_task("echo", mean_length=4)


def test_echo_sft_noise_is_a_successor_slip_at_the_given_rate():
    import random

    out = slip("az" * 2000, random.Random(0), 0.25)
    assert len(out) == 4000 and set(out[0::2]) <= {"a", "b"} and set(out[1::2]) <= {"z", "a"}
    changed = sum(a != b for a, b in zip(out, "az" * 2000)) / 4000
    assert changed == pytest.approx(0.25, abs=0.03)
    task, clean = make_task("echo"), make_task("echo", slip_prob=0.0)
    assert task.sft_pair(3) == task.sft_pair(3)
    for i in range(50):
        prompt, response = task.sft_pair(i)
        assert prompt == clean.sft_pair(i)[0] and len(response) == len(clean.sft_pair(i)[1])
        assert clean.sft_pair(i)[1] == clean.item(i).answer


# ---------------------------------------------------------------- tokenizer and model


def test_tokenizer_round_trip_and_save_load(tmp_path):
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "a3 b5 c2:"
    ids = encode_prompt(tok, text)
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    padded = encode_response(tok, "a3 b8 =8") + [tok.pad_token_id] * 3
    assert decode_response(tok, padded) == "a3 b8 =8"
    tok.save_pretrained(tmp_path)
    build_tiny_model(tok, SMALL_MODEL).save_pretrained(tmp_path)  # a qwen2 config beside it
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert encode_prompt(loaded, text) == ids and len(loaded) == len(tok)
    assert decode_response(loaded, encode_response(loaded, "x  y=1")) == "x  y=1"  # spaces kept
    for any_text in ANY_TEXT:
        assert encode_response(loaded, any_text) == encode_response(tok, any_text)
    assert loaded.chat_template == tok.chat_template


def test_vocabulary_specials_then_the_alphabet_then_every_byte_then_the_roles():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = build_tokenizer()
    assert len(tok) == 264 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert encode_response(tok, DEFAULT_ALPHABET) == [
        *range(4, 4 + len(DEFAULT_ALPHABET)),
        2,
    ]  # ids of the symbolic tasks
    vocab = tok.get_vocab()
    byte_ids = sorted(vocab[symbol] for symbol in bytes_to_unicode().values())
    assert byte_ids == list(range(4, 260))  # all 256 bytes, no merges
    assert [vocab[t] for t in ROLE_TOKENS] == [260, 261, 262, 263]
    assert encode_prompt(tok, "tom has 3 apples.") == [
        1,
        33,
        28,
        26,
        40,
        21,
        14,
        32,
        40,
        7,
        40,
        14,
        29,
        29,
        25,
        18,
        32,
        49,
    ]
    with pytest.raises(ValueError, match="ASCII"):
        build_tokenizer("abcé")


ANY_TEXT = [
    "A3",
    "Tom has 3 apples.\nHe buys 4 more.\n3 + 4 = 7\n#### 7",
    "a\tb\r\n",
    "emoji 😀!",
    "中文 テキスト",
    "nul \x00 and \x7f",
    "café ÆØÅ ß",
    "<eos> <pad> <|user|> spelt out",
    "  lead and trail  ",
]


@pytest.mark.parametrize("text", ANY_TEXT)
def test_any_text_encodes_one_id_per_byte_and_round_trips(text):
    tok = build_tokenizer()
    ids = encode_response(tok, text)
    assert len(ids) == len(text.encode()) + 1 and ids[-1] == tok.eos_token_id
    assert max(ids[:-1]) < 260 and min(ids[:-1]) >= 4  # bytes, never a special token
    assert decode_response(tok, ids) == text
    assert encode_prompt(tok, text) == [tok.bos_token_id, *ids[:-1]]


def test_chat_template_renders_roles_tool_calls_and_the_generation_prompt():
    tok = build_tokenizer()
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2*3?\nThanks"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "2*3"}}}],
        },
        {"role": "tool", "content": "6"},
    ]
    ids = encode_prompt(tok, chat)
    assert tok.decode(ids) == (
        "<bos><|system|>Be brief.<eos><|user|>What is 2*3?\nThanks<eos><|assistant|><tool_call>"
        '{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call><eos><|tool|>6<eos><|assistant|>'
    )
    assert ids[-1] == 262 and ids.count(tok.eos_token_id) == 4
    tools = [{"type": "function", "function": {"name": "calc"}}]
    with_tools = tok.decode(encode_prompt(tok, {"messages": chat[1:2], "tools": tools}))
    assert with_tools.startswith('<bos><|system|>tools: [{"type": "function"') and with_tools.endswith("<|assistant|>")
    with pytest.raises(Exception, match="unknown chat role: bot"):
        encode_prompt(tok, [{"role": "bot", "content": "hi"}])


def test_tiny_model_shape_and_head_dim_guard():
    tok = build_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig())
    cfg = model.config
    assert cfg.vocab_size == len(tok) and cfg.head_dim >= 32 and cfg.num_hidden_layers == 4
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    same = build_tiny_model(tok, TinyModelConfig())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelConfig(hidden_size=64, num_heads=4)


# ---------------------------------------------------------------- warm start


def test_sft_batch_trains_on_response_tokens_only():
    tok = build_tokenizer()
    batch = sft_batch(tok, [("a1:", "a1 =1"), ("a1 b2 c3:", "a1 b3 c6 =6")])
    labels, ids = batch["labels"], batch["input_ids"]
    assert labels.shape == ids.shape
    first = labels[0][labels[0] != -100].tolist()
    assert first == encode_response(tok, "a1 =1")  # eos included, prompt and padding masked
    assert batch["attention_mask"][0].sum() == len(encode_prompt(tok, "a1:")) + len(first)


def test_extra_chars_is_accepted_and_the_cache_key_follows_the_tokenizer_version(monkeypatch):
    import flash.train.sft as sft

    echo = make_task("echo")

    class WithExtraChars(type(echo)):  # user task code that still sets extra_chars
        extra_chars = '{}"_\u00e9'

    task = WithExtraChars(echo.options)
    assert task_tokenizer(task).get_vocab() == build_tokenizer().get_vocab()
    key = cache_key(SMALL_MODEL, SMALL_SFT, task)
    monkeypatch.setattr(sft, "TOKENIZER_VERSION", sft.TOKENIZER_VERSION + 1)
    assert cache_key(SMALL_MODEL, SMALL_SFT, task) != key


def test_warm_start_is_cached_loadable_and_reproducible(tmp_path, monkeypatch, caplog):
    task = make_task("chainsum", eval_size=4)
    with caplog.at_level("INFO", logger="flash.train.sft"):
        out = warm_start(SMALL_MODEL, SMALL_SFT, task, tmp_path / "a")
    assert sum("warm start chainsum" in r.getMessage() for r in caplog.records) == 1
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tok)
    meta = json.load(open(os.path.join(out, META_FILE)))
    assert meta["task"]["options"]["eval_size"] == 4 and 0.0 <= meta["eval_accuracy"] <= 1.0
    assert [p for p in os.listdir(tmp_path / "a") if p.startswith(".tmp")] == []

    import flash.train.sft as sft

    monkeypatch.setattr(sft, "_train_and_save", lambda *a: pytest.fail("cache miss"))
    assert warm_start(SMALL_MODEL, SMALL_SFT, task, tmp_path / "a") == out  # hit: no training
    monkeypatch.undo()

    again = warm_start(SMALL_MODEL, SMALL_SFT, task, tmp_path / "b")  # fresh cache, same configs
    twin = AutoModelForCausalLM.from_pretrained(again)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_cache_key_covers_every_config():
    task = make_task("chainsum")
    base = cache_key(SMALL_MODEL, SMALL_SFT, task)
    assert cache_key(SMALL_MODEL, SMALL_SFT, make_task("chainsum")) == base
    assert cache_key(SMALL_MODEL, dataclasses.replace(SMALL_SFT, lr=1e-4), task) != base
    assert cache_key(dataclasses.replace(SMALL_MODEL, seed=1), SMALL_SFT, task) != base
    assert cache_key(SMALL_MODEL, SMALL_SFT, make_task("chainsum", slip_prob=0.1)) != base
    assert cache_key(SMALL_MODEL, SMALL_SFT, make_task("stutter")) != base


TASK_SOURCE = """
from flash.recipes.tasks.echo import Echo


class EditedEcho(Echo):
    def sft_pair(self, index):
        prompt, response = super().sft_pair(index)
        return prompt, {response}
"""


def _task_from_file(path, body: str):
    import importlib.util

    path.write_text(TASK_SOURCE.replace("{response}", body))
    spec = importlib.util.spec_from_file_location(f"edited_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import leaves it
    spec.loader.exec_module(module)
    return module.EditedEcho(make_task("echo").options)


def test_cache_key_follows_the_tasks_code(tmp_path):
    """The same name and options with edited demonstrations code is another warm start."""
    a = _task_from_file(tmp_path / "a.py", "response")
    b = _task_from_file(tmp_path / "b.py", "response[::-1]")
    same = _task_from_file(tmp_path / "c.py", "response")
    assert a.sft_pair(3) != b.sft_pair(3) and a.options == b.options
    assert cache_key(SMALL_MODEL, SMALL_SFT, a) != cache_key(SMALL_MODEL, SMALL_SFT, b)
    assert cache_key(SMALL_MODEL, SMALL_SFT, a) == cache_key(SMALL_MODEL, SMALL_SFT, same)


def test_failed_training_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    import flash.train.sft as sft

    def boom(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(sft, "train_sft", boom)
    with pytest.raises(RuntimeError):
        warm_start(SMALL_MODEL, SMALL_SFT, make_task("chainsum"), tmp_path)
    assert os.listdir(tmp_path) == []
