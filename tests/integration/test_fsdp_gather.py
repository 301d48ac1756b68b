"""The flat gather of an FSDP2 state dict (``flash.weights.gather``) against ``get_model_state_dict``.

The layout is checked by hand without processes (uneven and empty shards), then two gloo ranks
shard real models and rank 0 compares the flat gather with ``get_model_state_dict(full_state_dict)``
tensor for tensor: exact values, names in order, dtypes, shapes, tied names sharing one tensor.
"""

import pytest
import torch

from flash.weights.gather import Entry, pack, plan_buckets, rank_rows, unpack


def test_rank_rows_follow_torch_chunk():
    for d0 in range(12):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(d0).chunk(world) if d0 else ()
            want = [len(c) for c in chunks] + [0] * (world - len(chunks))
            assert [rank_rows(d0, world, r) for r in range(world)] == want, (d0, world)
    assert [rank_rows(5, 4, r) for r in range(4)] == [2, 2, 1, 0]  # the last rank holds nothing


def test_pack_then_unpack_is_the_identity_on_uneven_shards():
    """Each rank's local shards (torch.chunk, as FSDP2) packed, buffers end to end, unpacked."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (1, 4), (7,), (2, 2, 2), (0, 3), (4, 1)]
    full = [torch.randn(s, generator=g) for s in shapes]
    bucket = [Entry((f"t{i}",), s, torch.float32, True) for i, s in enumerate(shapes)]

    def local(t, r, world):
        rows = -(-t.shape[0] // world)
        return t[r * rows : (r + 1) * rows]

    for world in (1, 2, 3, 4):
        flats = [pack(bucket, [local(t, r, world) for t in full], world) for r in range(world)]
        assert len({f.numel() for f in flats}) == 1  # equal-sized, as a gather needs
        got = unpack(torch.cat(flats), bucket, world)
        assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(got, full, strict=True)), world


def test_buckets_group_by_dtype_and_respect_the_budget():
    e = lambda name, shape, dtype=torch.float32, sharded=True: Entry((name,), shape, dtype, sharded)
    entries = [
        e("a", (4, 4)),
        e("h", (2, 2), torch.bfloat16),
        e("b", (4, 4)),
        e("buf", (3,), sharded=False),
        e("c", (64, 4)),
        e("d", (1,)),
    ]
    # world 2: a, b = 64 B gathered each, c = 1024 B (over budget: alone), d = 8 B (2 rows of 1)
    got = [[x.names[0] for x in b] for b in plan_buckets(entries, 2, bucket_bytes=128)]
    assert got == [["a", "b"], ["c"], ["d"], ["h"]]
    assert [[x.names[0] for x in b] for b in plan_buckets(entries, 2, 1 << 20)] == [["a", "b", "c", "d"], ["h"]]


# ---------------------------------------------------------------- two gloo ranks (spawned)


class Odd(torch.nn.Module):
    """Uneven first dims on 2 ranks (7: 4+3, 3: 2+1, 1: 1+0), a tied head, a bf16 parameter, a
    1-D parameter, buffers (one persistent, one not) and a parameter FSDP ignores (stays plain)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 6)
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Linear(3, 6))
        self.head = torch.nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight
        self.row = torch.nn.Parameter(torch.randn(1, 5))
        self.scale = torch.nn.Parameter(torch.randn(5))
        self.low = torch.nn.Parameter(torch.randn(3, 4).to(torch.bfloat16))
        self.loose = torch.nn.Parameter(torch.randn(3, 2))
        self.register_buffer("stat", torch.randn(5))
        self.register_buffer("scratch", torch.randn(2), persistent=False)


def _tiny_qwen():
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

    return build_tiny_model(
        build_tokenizer(),
        TinyModelConfig(
            hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=96, max_positions=64
        ),
    )


def _reference(model, every_rank=False):
    """``get_model_state_dict``'s full state dict: on rank 0 (cpu_offload, what mu_gather used), or
    on every rank (no offload; on the CPU the same tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=opts)


def _same(got, want, ties):
    assert got is not None and list(got) == list(want)  # names, in order
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape and g.device.type == "cpu", name
        assert torch.equal(g, t), name
    for names in ties:
        assert all(got[n] is got[names[0]] for n in names), names  # tied: one tensor, gathered once


def _check_models(rank: int, mesh) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from flash.train.fsdp import shard_model
    from flash.weights.gather import FlatGather, gather_full_state

    torch.manual_seed(0)  # every rank builds the same weights
    qwen = _tiny_qwen()
    shard_model(qwen, mesh)
    odd = Odd()
    fully_shard(odd.block[0], mesh=mesh)
    fully_shard(odd, mesh=mesh, ignored_params={odd.loose})
    planned = FlatGather(qwen)  # a plan made before the values change, as at a group's setup
    with torch.no_grad():  # a step's worth of change, so nothing compares to the initial values
        for p in [*qwen.parameters(), *odd.parameters()]:
            p.add_(0.5)
    cases = [
        (qwen, 256 << 20, [("model.embed_tokens.weight", "lm_head.weight")]),
        (odd, 256 << 20, [("emb.weight", "head.weight")]),
        (odd, 40, [("emb.weight", "head.weight")]),
    ]  # tiny budget: a bucket per tensor
    for model, budget, ties in cases:
        got = gather_full_state(model, bucket_bytes=budget)
        want = _reference(model)
        if rank == 0:
            _same(got, want, ties)
            assert model is qwen or "stat" in got and "scratch" not in got and got["low"].dtype == torch.bfloat16
        else:
            assert got is None  # only rank 0 materialises
    for dst in (0, 1):  # the plan made before the change reads the live values; any rank may receive
        got, want = planned(dst=dst), _reference(qwen, every_rank=True)
        if rank == dst:
            _same(got, want, [("model.embed_tokens.weight", "lm_head.weight")])
        else:
            assert got is None
    if rank == 0:  # a copy: changing the live model after the gather leaves it alone
        got = gather_full_state(odd)
        with torch.no_grad():
            odd.stat.add_(1.0)
            odd.loose.add_(1.0)
        assert not torch.equal(got["stat"], odd.stat) and not torch.equal(got["loose"], odd.loose)
    else:
        gather_full_state(odd)
    dist.barrier()


def _check_unsupported(rank: int, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from flash.weights.gather import gather_full_state, sharded_state, unsupported

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
    reason = unsupported(sharded_state(model))
    assert reason == "0.weight is placed S(1) (only Shard(0) and Replicate are gathered flat)", reason
    with pytest.raises(ValueError, match=r"flat gather does not cover this model: 0.weight is placed S\(1\)"):
        gather_full_state(model)


def _ranks_main(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        _check_models(rank, mesh)
        _check_unsupported(rank, mesh)
    finally:
        dist.destroy_process_group()


def test_two_ranks_gather_exactly_what_get_model_state_dict_gathers():
    import torch.multiprocessing as mp

    from flash.train.fsdp import free_port

    mp.spawn(_ranks_main, args=(2, free_port()), nprocs=2, join=True)
