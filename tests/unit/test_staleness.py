"""Admission control and batch selection: the staleness bound under random completion orders."""

import math
import random

import pytest

from flash.controllers.staleness import StalenessManager


def test_admission_limit_formula():
    sm = StalenessManager(async_ratio=2, prompts_per_step=4)
    assert [sm.admission_limit(t) for t in range(3)] == [12, 16, 20]
    sm = StalenessManager(async_ratio=0.5, prompts_per_step=4)
    assert [sm.admission_limit(t) for t in range(3)] == [6, 10, 14]  # floor((t + 1.5) * 4)
    sm = StalenessManager(async_ratio=0, prompts_per_step=3)
    assert sm.can_admit(2, 0) and not sm.can_admit(3, 0) and sm.can_admit(3, 1)
    assert sm.max_staleness == 0


def test_admission_admits_up_to_the_bound_then_spares_and_owns_its_checkpoint_state():
    from types import SimpleNamespace

    from flash.controllers.admission import Admission, PromptSource

    source = PromptSource(
        item=lambda i: SimpleNamespace(prompt=str(i)), encode=lambda p: [int(p)], decode=str, reward=None
    )
    adm = Admission(StalenessManager(async_ratio=1, prompts_per_step=2), source, max_additional=1, start_index=5)
    taken = []
    while (action := adm.next_action()) is not None:
        index, _, ids = adm.take()
        taken.append((action[0], adm.new_prompt(spare=action[0] == "spare"), index, ids))
    # floor((0 + 1 + 1) * 2) = 4 counted prompts, then the one spare; ids and data positions in order
    assert taken == [
        ("admit", 0, 5, [5]),
        ("admit", 1, 6, [6]),
        ("admit", 2, 7, [7]),
        ("admit", 3, 8, [8]),
        ("spare", 4, 9, [9]),
    ]
    assert adm.move_to(1) == [4]  # the spare of version 0 ends
    assert adm.next_action() == ("admit", None)  # 4 < floor((1 + 1 + 1) * 2)
    assert adm.state_dict() == {
        "admitted": 5,
        "next_index": 10,
        "version": 1,
        "waves": 0,
        "provisioning": {"counted": 4},
    }
    old = Admission(StalenessManager(1, 2), source)
    old.load_state_dict({"admitted": 3, "next_index": 7, "version": 2})  # a checkpoint without waves
    assert (old.admitted, old.next_index, old.version, old.waves, old.prov.counted) == (3, 7, 2, 0, 3)


def test_negative_ratio_rejected():
    with pytest.raises(ValueError):
        StalenessManager(-1, 4)


def test_select_oldest_first_and_waits_for_due_group():
    sm = StalenessManager(async_ratio=2, prompts_per_step=1)
    # step 2: a version-0 group still in flight is due at step 2 (0 + ceil(2)); a newer finished
    # group must not take its place.
    assert sm.select_batch(2, finished=[1], pending=[0]) is None
    assert sm.select_batch(2, finished=[1, 0], pending=[]) == [1]
    # step 1 with two version-0 groups pending: taking the version-1 group now would leave two
    # groups due at step 2 with room for one.
    assert sm.select_batch(1, finished=[1], pending=[0, 0]) is None
    assert sm.select_batch(1, finished=[1], pending=[0]) == [0]


def simulate(r: float, B: int, steps: int, seed: int, skew: float = 3.0):
    """Admission + random completion + select_batch; returns the staleness of every trained group."""
    rng = random.Random(seed)
    sm = StalenessManager(r, B)
    admitted, version, clock = 0, 0, 0.0
    inflight: list[tuple[float, int, int]] = []  # (finish time, admission version, id)
    finished: list[tuple[int, int]] = []  # (version, id)
    trained, staleness = set(), []
    for t in range(steps):
        while sm.can_admit(admitted, version):
            # long-tailed durations: most short, a few very long
            dur = rng.expovariate(1.0) * (skew if rng.random() < 0.2 else 1.0)
            inflight.append((clock + dur, version, admitted))
            admitted += 1
        while True:
            pick = sm.select_batch(t, [v for v, _ in finished], [v for _, v, _ in inflight])
            if pick is not None:
                break
            assert inflight, f"deadlock at step {t}: nothing in flight, no batch accepted"
            inflight.sort()
            done, v, gid = inflight.pop(0)
            clock = max(clock, done)
            finished.append((v, gid))
        batch = [finished[i] for i in pick]
        finished = [f for i, f in enumerate(finished) if i not in set(pick)]
        for v, gid in batch:
            assert gid not in trained
            trained.add(gid)
            staleness.append(t - v)
        version += 1
    return staleness, trained, admitted, finished, inflight


@pytest.mark.parametrize("r", [0, 0.5, 1, 2, 3.7, 8])
@pytest.mark.parametrize("seed", range(5))
def test_bound_holds_under_random_completion(r, seed):
    B = 4
    staleness, trained, admitted, finished, inflight = simulate(r, B, steps=40, seed=seed)
    assert len(staleness) == 40 * B
    assert max(staleness) <= math.ceil(r)
    # nothing lost or duplicated: every admitted group is trained, finished-waiting or in flight
    ids = sorted(list(trained) + [g for _, g in finished] + [g for _, _, g in inflight])
    assert ids == list(range(admitted))
    assert admitted == math.floor((40 + r) * B + 1e-9)


def test_async_actually_uses_stale_samples():
    """With r = 2 and long tails the selector does train older groups (it is not just sync)."""
    staleness, *_ = simulate(2, 4, steps=40, seed=1)
    assert max(staleness) == 2
    assert sum(staleness) / len(staleness) > 0.5
