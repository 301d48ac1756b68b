"""flash.train.logprobs: logprobs over the response span in chunks, bit for bit those of one pass
over every position (float32, CPU), and the memory this saves at Qwen2.5's vocabulary, traced on
fake tensors (bench.logprob_memory); the entropy only on the steps that log or need it."""

import copy
from unittest import mock

import pytest
import torch

from flash import algos
import flash.train.trainer as trainer_mod
from bench.logprob_memory import GIB, micro_batch_peak, unchunked_logprobs
from flash.app.config import load_config
from flash.app.recipe_files import recipe_paths
from flash.errors import ConfigError
from flash.train.batch import TrainBatch, collate, response_starts
from flash.train.logprobs import chunk_columns, token_logprobs
from flash.train.trainer import RowSpans, Trainer, row_spans_and_weight
from tests.helpers.models import make_model
from tests.helpers.train import toy_model, toy_samples, toy_settings


def random_batch(vocab: int, rows: int = 4, length: int = 48, seed: int = 0) -> TrainBatch:
    """Rows of random tokens with prompts of 7..23 tokens and lengths 32..``length`` (one that long)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    prompt = torch.randint(8, 24, (rows,), generator=g)
    lengths = torch.randint(32, length + 1, (rows,), generator=g)
    lengths[1] = length
    cols = torch.arange(length - 1)[None]
    mask = ((cols >= prompt[:, None] - 1) & (cols < lengths[:, None] - 1)).float()
    return TrainBatch(
        ids,
        (torch.arange(length)[None] < lengths[:, None]).long(),
        mask,
        torch.zeros(rows, length - 1),
        torch.zeros(rows, length - 1, dtype=torch.long),
        torch.zeros(rows),
        torch.zeros(rows, dtype=torch.long),
    )


def test_chunks_equal_one_pass_bit_for_bit_logprobs_entropy_and_every_gradient():
    _, model = make_model(0)
    model.train()
    vocab = model.config.vocab_size
    batch = random_batch(vocab)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))
    start = int(response_starts(batch.mask).min())

    def run(fn):
        model.zero_grad()
        logp, entropy = fn()
        loss = (logp * batch.mask * weights).sum() + 0.01 * (entropy * batch.mask).sum()  # an entropy bonus
        loss.backward()
        return logp * batch.mask, entropy * batch.mask, {k: p.grad.clone() for k, p in model.named_parameters()}

    want = run(lambda: unchunked_logprobs(model, batch, 0.7, True, True))
    for columns in (5, 1000):  # 5 does not divide the 47 - start columns
        got = run(
            lambda c=columns: token_logprobs(
                model, batch, 0.7, True, True, start=start, chunk_bytes=c * len(batch) * vocab * 4
            )
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), columns
        assert [k for k in want[2] if not torch.equal(got[2][k], want[2][k])] == [], columns


def test_prompt_columns_are_zero_and_start_is_clamped():
    _, model = make_model(1)
    batch = random_batch(model.config.vocab_size, rows=3)
    with torch.no_grad():
        full, _ = unchunked_logprobs(model.eval(), batch, 1.0)
        logp, entropy = token_logprobs(model, batch, 1.0, start=12, chunk_bytes=1)
        last, _ = token_logprobs(model, batch, 1.0, start=500)
    assert entropy is None and chunk_columns(3, model.config.vocab_size, 1) == 1
    assert torch.equal(logp[:, 12:], full[:, 12:]) and not logp[:, :12].any()
    assert torch.equal(last[:, -1], full[:, -1]) and not last[:, :-1].any()  # the last column at least


def test_row_spans_read_lengths_and_first_response_columns_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0.0]])
    assert response_starts(mask).tolist() == [2, 1, 5]
    batch = TrainBatch(
        torch.zeros(3, 6, dtype=torch.long),
        torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6, [1, 1, 0, 0, 0, 0]]),
        mask,
        torch.zeros(3, 5),
        torch.zeros(3, 5, dtype=torch.long),
        torch.zeros(3),
        torch.zeros(3, dtype=torch.long),
    )
    spans, weight = row_spans_and_weight("token-mean", batch, [0, 2])
    assert spans == RowSpans([5, 6, 2], [2, 1, 5]) and weight == 2.0
    assert spans.of([0, 2]) == (5, 2) and spans.of(range(3)) == (6, 1)


@pytest.mark.cpu_budget(5)  # a fake-tensor trace of a step at Qwen2.5's vocabulary
def test_memory_of_one_micro_batch_at_qwen25_vocabulary_is_bounded():
    """8 × 1024 tokens (256 of prompt), 151,936 ids, float32, entropy logged: 12.06 GiB traced, where
    one pass over every position (the full-vocabulary fp32 copies, prompts included) holds 20.07
    (``python -m bench.logprob_memory`` measures both)."""
    assert micro_batch_peak(dtype="float32", entropy=True) / GIB < 12.5


def test_a_trainer_step_matches_one_pass_bit_for_bit_in_float32():
    """Micro-batches of 2 rows (each its own start), a local KL reference (no-gradient logprobs)
    and an entropy bonus: loss, gradient norm and the updated weights equal those of the same
    trainer with the one-pass logprobs."""
    batch = collate(toy_samples(n=6))
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    loss = {"name": "vanilla", "kl_coef": 0.1, "entropy_coef": 0.01}
    runs = []
    for fn in (unchunked_logprobs, token_logprobs):
        with mock.patch.object(trainer_mod, "token_logprobs", fn):
            tr = Trainer(copy.deepcopy(toy_model()), toy_settings(micro_batch_size=2, loss=loss))
            metrics = tr.train_step(batch, adv, None)
        runs.append((metrics, [p.detach().clone() for p in tr.model.parameters()]))
    (a, wa), (b, wb) = runs
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["entropy"] == b["entropy"]
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def test_entropy_only_on_logging_steps_or_where_a_loss_needs_it():
    batch = collate(toy_samples(n=4))
    adv = torch.ones(batch.mask.shape) * batch.mask
    seen = {}
    for every, loss in (
        (2, {"name": "vanilla"}),
        (0, {"name": "vanilla"}),
        (0, {"name": "vanilla", "entropy_coef": 0.01}),
    ):
        tr = Trainer(toy_model(), toy_settings(entropy_every_steps=every, loss=loss))
        seen[(every, "entropy_coef" in loss)] = ["entropy" in tr.train_step(batch, adv, None) for _ in range(3)]
    assert seen == {(2, False): [True, False, True], (0, False): [False] * 3, (0, True): [True] * 3}
    assert algos.kl_coef({"name": "vanilla"}) == 0.0  # no reference copy in these trainers


def test_entropy_interval_is_in_the_strict_config():
    cfg = load_config(recipe_paths()["stutter"], ["train.entropy_every_steps=10"])
    assert cfg.train.entropy_every_steps == 10
    with pytest.raises(ConfigError, match="train.entropy_every_steps must be >= 0"):
        load_config(recipe_paths()["stutter"], ["train.entropy_every_steps=-1"])
    with pytest.raises(ConfigError, match="entropy_every_step"):
        load_config(recipe_paths()["stutter"], ["train.entropy_every_step=10"])
