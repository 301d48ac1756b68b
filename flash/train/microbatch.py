"""How a train batch is split across FSDP ranks and into micro-batches (pure functions, no torch.distributed).

Three decisions, each a small function with its own tests:

1. ``shard_rows``: which rows each rank trains on. Rows go, longest first, to the rank with the
   fewest tokens so far (greedy balancing): FSDP ranks wait for each other at every layer, so the
   slowest rank sets the pace.
2. ``micro_batches``: a rank's rows grouped by length into micro-batches whose *padded* size
   (rows × longest row) stays within a token budget. Grouping similar lengths wastes little padding,
   and a budget in tokens (not rows) keeps the activation memory of a micro-batch bounded whatever
   the lengths. A row longer than the whole budget cannot be split (attention needs the whole
   sequence), so it forms a micro-batch alone and is counted (``over_budget``), never dropped.
3. ``equalize``: every rank must run the *same number* of forward/backward passes, because each
   pass all-gathers parameters and reduce-scatters gradients across all ranks; a rank that skipped
   one would hang the others. Ranks with fewer micro-batches split their largest ones; when no
   micro-batch has two rows left to split, the rank runs a padding pass with loss weight 0
   (``None`` in the plan, counted as ``pad_micro_batches``).

The weight of each micro-batch in the loss is *global* (``flash.train.trainer.micro_weight`` with the
whole batch's token and row counts), so the per-rank sums of weighted micro-losses add up, over
ranks, to exactly the single-process loss for every aggregation mode.
"""

from __future__ import annotations

from dataclasses import dataclass

Plan = list[list[int] | None]  # per micro-batch: batch row indices, or None for a padding pass


@dataclass(frozen=True)
class MicroPlan:
    """Every rank's micro-batches (row indices into the whole batch), equal in number."""

    ranks: list[Plan]
    over_budget: int  # rows longer than the token budget (each trained alone)
    pad_micro_batches: int  # zero-weight passes added so that ranks stay in step

    @property
    def count(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0


def shard_rows(lengths: list[int], world: int) -> list[list[int]]:
    """Rows per rank, balanced by tokens; each row exactly once, each list ascending.

    Longest row first to the least-loaded rank (ties: the lowest rank), so with at least ``world``
    rows every rank gets one.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    loads = [0] * world
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shards]


def micro_batches(rows: list[int], lengths: list[int], max_tokens: int, max_rows: int) -> tuple[list[list[int]], int]:
    """Length-grouped micro-batches of ``rows`` with padded size <= ``max_tokens`` (0: no token cap)
    and at most ``max_rows`` rows; returns (micro-batches, rows over the token budget)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    order = sorted(rows, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    over = 0
    for i in order:
        cur = out[-1] if out else None
        # rows come longest first, so the micro-batch's padded width is its first row's length
        fits = (
            cur is not None
            and len(cur) < max_rows
            and (max_tokens <= 0 or (len(cur) + 1) * lengths[cur[0]] <= max_tokens)
        )
        if fits:
            cur.append(i)
            continue
        out.append([i])
        if max_tokens > 0 and lengths[i] > max_tokens:
            over += 1
    return [sorted(mb) for mb in out], over


def equalize(plans: list[list[list[int]]]) -> tuple[list[Plan], int]:
    """Give every rank the same number of micro-batches; returns (plans, padding passes added).

    Splitting the largest micro-batch in two keeps each half within the token budget (same width,
    fewer rows), so splits are preferred to padding passes, which cost a forward and backward each.
    """
    target = max((len(p) for p in plans), default=0)
    target = max(target, 1)  # even an empty batch takes one (padding) pass on every rank
    out: list[Plan] = []
    pads = 0
    for plan in plans:
        plan = [list(mb) for mb in plan]
        while len(plan) < target:
            biggest = max(range(len(plan)), key=lambda k: len(plan[k]), default=None)
            if biggest is None or len(plan[biggest]) < 2:
                break
            mb = plan.pop(biggest)
            plan[biggest:biggest] = [mb[: len(mb) // 2], mb[len(mb) // 2 :]]
        pads += target - len(plan)
        out.append(plan + [None] * (target - len(plan)))
    return out, pads


def plan_batch(lengths: list[int], world: int, max_tokens: int, max_rows: int) -> MicroPlan:
    """Shard rows over ``world`` ranks, group each shard into micro-batches, equalize the counts."""
    per_rank, over = [], 0
    for rows in shard_rows(lengths, world):
        mbs, o = micro_batches(rows, lengths, max_tokens, max_rows)
        per_rank.append(mbs)
        over += o
    ranks, pads = equalize(per_rank)
    return MicroPlan(ranks=ranks, over_budget=over, pad_micro_batches=pads)
