"""GPU cost models: how long a decode step, a prefill, a train step and a weight push take.

Roofline, from first principles, with measured efficiencies where a published figure gives one:

    decode step (one token for each of ``b`` sequences holding ``C`` context tokens in all, on one
    engine instance of ``tp`` GPUs):
        max( (weight bytes + KV bytes/token · C) / (tp · HBM bandwidth · η_hbm),   memory-bound
             2 · params · b / (tp · peak · MFU_decode) )                            compute-bound
        + a fixed per-step overhead (scheduling, sampling, kernel launches)
        + host work per sequence · b + per context token · C   (0 on the GPU presets; what
                                                                 dominates a tiny model on a CPU)
    prefill of ``n`` tokens:   2 · params · n / (tp · peak · MFU_prefill)
    train step over ``n`` tokens on ``g`` GPUs:  6 · params · n · passes / (g · peak · MFU_train)
                                                 + a fixed overhead per pass (optimizer, launches)
    weight push:               weight bytes / link bandwidth + latency

Departures: attention FLOPs (quadratic in context) are left out of prefill and training, which
undercounts long-context prefill; the decode step reads all KV once per step (paged attention)
and treats the batch's context as spread evenly over the instance's sequences.

Every function is pure; ``PRESETS`` names the models a recipe picks with ``sim.model``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes_per_s: float


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # BF16 weights and KV cache

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token (grouped-query attention: ``kv_heads`` heads)."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True)
class Efficiency:
    hbm: float  # fraction of peak HBM bandwidth a memory-bound decode step achieves
    decode_mfu: float  # model FLOPs utilisation of a compute-bound decode step
    prefill_mfu: float
    train_mfu: float
    step_overhead_s: float  # per decode step, beside the GPU work
    sync_bytes_per_s: float  # trainer → engines weight broadcast, per receiver (they receive at once)
    sync_latency_s: float  # per push: gather, rendezvous, cache reset
    seq_overhead_s: float = 0.0  # per running sequence per decode step (host: sampling, bookkeeping)
    context_overhead_s: float = 0.0  # per context token per decode step beyond the roofline (attention)
    train_overhead_s: float = 0.0  # per pass over a batch (optimizer step, launches)


@dataclass(frozen=True)
class CostModel:
    model: Model
    gpu: Gpu
    eff: Efficiency
    tp: int = 1  # GPUs per engine instance (tensor parallel)

    def with_tp(self, tp: int) -> CostModel:
        return replace(self, tp=tp)


def decode_step_s(cm: CostModel, batch: int, context_tokens: float) -> float:
    """One decode iteration of one engine instance: ``batch`` sequences, ``context_tokens`` in all."""
    if batch <= 0:
        return 0.0
    m, g, e = cm.model, cm.gpu, cm.eff
    memory = (m.weight_bytes + m.kv_bytes_per_token * context_tokens) / (cm.tp * g.hbm_bytes_per_s * e.hbm)
    compute = 2.0 * m.params * batch / (cm.tp * g.peak_flops * e.decode_mfu)
    return max(memory, compute) + e.step_overhead_s + e.seq_overhead_s * batch + e.context_overhead_s * context_tokens


def decode_run_s(cm: CostModel, batch: int, context_tokens: float, iterations: int) -> float:
    """``iterations`` decode steps of a fixed batch whose context grows by ``batch`` per step.

    The context terms are linear in the context, so the sum equals ``iterations`` steps at the mean
    context (exact while the step stays on one side of the roofline)."""
    if iterations <= 0 or batch <= 0:
        return 0.0
    return iterations * decode_step_s(cm, batch, context_tokens + batch * (iterations - 1) / 2.0)


def prefill_s(cm: CostModel, tokens: float) -> float:
    """Prefill (or re-prefill after a weight update) of ``tokens`` on one engine instance."""
    return 2.0 * cm.model.params * max(0.0, tokens) / (cm.tp * cm.gpu.peak_flops * cm.eff.prefill_mfu)


def train_step_s(cm: CostModel, tokens: float, gpus: int, passes: int = 1) -> float:
    """Forward and backward (3 × the forward's 2·params FLOPs per token) over ``tokens``, ``passes`` times."""
    flops = 6.0 * cm.model.params * tokens * passes / (max(1, gpus) * cm.gpu.peak_flops * cm.eff.train_mfu)
    return flops + passes * cm.eff.train_overhead_s


def forward_s(cm: CostModel, tokens: float, gpus: int) -> float:
    """A no-gradient forward (proximal logprobs) over ``tokens``."""
    return 2.0 * cm.model.params * tokens / (max(1, gpus) * cm.gpu.peak_flops * cm.eff.train_mfu)


def weight_sync_s(cm: CostModel) -> float:
    """Push every weight to the engines: they receive in parallel (a broadcast)."""
    return cm.model.weight_bytes / cm.eff.sync_bytes_per_s + cm.eff.sync_latency_s


# ---- presets -----------------------------------------------------------------------------------
# NVIDIA H100 SXM5: 989.4 TFLOPS dense BF16, 3.35 TB/s HBM3 (NVIDIA H100 datasheet / Hopper
# whitepaper; tabulated at https://glennklockwood.com/garden/processors/h100).
H100_SXM = Gpu("h100-sxm", peak_flops=989.4e12, hbm_bytes_per_s=3.35e12)

# Qwen2.5-7B: 7.61 B parameters, 28 layers, 4 KV heads of dim 128 (hidden 3584 / 28 heads);
# Qwen2.5 technical report (arXiv 2412.15115) Table 1 and the model's config.json.
QWEN25_7B = Model("qwen2.5-7b", params=7.61e9, layers=28, kv_heads=4, head_dim=128)
# Qwen2.5-0.5B: 494 M parameters (tied embeddings), 24 layers, 2 KV heads of dim 64 (hidden 896 / 14
# heads); the model's config.json (bench/gpu.py builds the same shape and pins its parameter count).
QWEN25_05B = Model("qwen2.5-0.5b", params=0.494e9, layers=24, kv_heads=2, head_dim=64)
# Qwen2.5-32B: 32.5 B parameters, 64 layers, 8 KV heads of dim 128 (hidden 5120 / 40 heads); same sources.
QWEN25_32B = Model("qwen2.5-32b", params=32.5e9, layers=64, kv_heads=8, head_dim=128)

H100_VLLM = Efficiency(
    # vLLM decode at batch 1 reaches ~77% of the memory-bandwidth roofline (Llama-3.1-8B, A100,
    # vLLM 0.23: https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on). Measured on A100, not
    # H100: taken as the H100 figure too (not verified on H100).
    hbm=0.77,
    # Not verified against a published measurement: first-principles choices. 0.5 MFU for large
    # GEMMs (prefill, compute-bound decode) is the usual Hopper BF16 figure for vLLM-class kernels.
    decode_mfu=0.5,
    prefill_mfu=0.5,
    # Not verified: 35% MFU, the middle of what FSDP/Megatron RL trainers report for 7–32B models.
    train_mfu=0.35,
    # Not verified: ~3 ms per decode step of CPU-side scheduling and sampling (vLLM V1 order).
    step_overhead_s=0.003,
    # Not verified: NCCL broadcast at ~25 GB/s effective over 400 Gb/s InfiniBand (50 GB/s line
    # rate, about half achieved with bucketing), plus 0.5 s per push for gather and cache reset.
    sync_bytes_per_s=25e9,
    sync_latency_s=0.5,
)
# Cross-check of the 7B preset at tp 1: batch 256 with 1,500 context tokens each gives
# max(14.4 ms, 7.9 ms) + 3 ms = 17.4 ms per step, 14.7k tokens/s; third-party vLLM figures for
# Llama-3.1-8B on one H100 are ~12.5k tokens/s (https://www.morphllm.com/vllm-benchmarks): within 20%.

# The default recipe's tiny Qwen2 (flash.models.TinyModelConfig: hidden 128, 4 layers, 4 KV heads of
# dim 32, fp32) on this machine's 2 shared cores, one preset per torch thread count (a synchronous
# run gives each role both cores, an async one one each). Every number fitted on this machine by
# bench/sim_fit.py (load average 6-7), what the roofline leaves of a decode step fitted as host
# work (a tiny model's step is nearly all of it); the push is in-process (a Ray transfer adds to it).
TINY_QWEN2 = Model("tiny-qwen2", params=862_100, layers=4, kv_heads=4, head_dim=32, bytes_per_param=4)
CPU_1T = Gpu("cpu-1-thread", peak_flops=77.0e9, hbm_bytes_per_s=21.4e9)  # fp32 1024² GEMM, 64 MB copy
CPU_2T = Gpu("cpu-2-threads", peak_flops=79.7e9, hbm_bytes_per_s=17.0e9)
TORCH_CPU_1T = Efficiency(
    hbm=1.0,
    decode_mfu=1.0,
    prefill_mfu=0.33,
    train_mfu=0.203,
    step_overhead_s=4.81e-3,
    sync_bytes_per_s=21.4e9,
    sync_latency_s=1.9e-3,
    seq_overhead_s=58.3e-6,
    context_overhead_s=0.438e-6,
    train_overhead_s=0.0,
)
TORCH_CPU_2T = Efficiency(
    hbm=1.0,
    decode_mfu=1.0,
    prefill_mfu=0.40,
    train_mfu=0.203,
    step_overhead_s=5.79e-3,
    sync_bytes_per_s=17.0e9,
    sync_latency_s=2.5e-3,
    seq_overhead_s=52.1e-6,
    context_overhead_s=1.03e-6,
    train_overhead_s=0.060,
)

PRESETS: dict[str, CostModel] = {
    "qwen2.5-7b-h100": CostModel(QWEN25_7B, H100_SXM, H100_VLLM, tp=1),
    "qwen2.5-0.5b-h100": CostModel(QWEN25_05B, H100_SXM, H100_VLLM, tp=1),
    # 65 GB of BF16 weights leave too little of an 80 GB H100 for KV: served at tp 4
    "qwen2.5-32b-h100": CostModel(QWEN25_32B, H100_SXM, H100_VLLM, tp=4),
    "tiny-cpu-1t": CostModel(TINY_QWEN2, CPU_1T, TORCH_CPU_1T),
    "tiny-cpu-2t": CostModel(TINY_QWEN2, CPU_2T, TORCH_CPU_2T),
}


def preset(name: str) -> CostModel:
    """The named preset; a ``ValueError`` naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown sim.model {name!r}; expected one of {', '.join(PRESETS)}") from None
