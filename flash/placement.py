"""AutoDeviceMapping: where each role runs, from a YAML mapping of roles to device indices.

Each role (``actor_train``, ``actor_infer``, ``reward``, ``env``, ``reference``, ``critic``) has a
``device_mapping`` (device indices; empty = a CPU-only role) and ``num_workers``; worker ``i`` of a
role owns ``device_mapping[i*d:(i+1)*d]`` with ``d = len(device_mapping) / num_workers`` devices
(``d > 1``: e.g. a tensor-parallel engine). Two roles whose mappings are the *same* device set are
**colocated** (they take turns: the engine releases memory while the trainer runs); *disjoint*
mappings are **disaggregated** (they run at the same time). Anything in between is an error,
because a half-shared device set has no schedule that is both safe and fast.

Two steps, so that the decisions can be tested without Ray:
- ``plan_placement`` (pure): config → ``Plan``, or a ``PlacementError`` naming what conflicts.
- ``Placement.create`` (Ray): one placement group with one ``{"GPU": 1, "CPU": c}`` bundle per
  device index, so that device ``d`` is bundle ``d`` (on a machine flash has to itself, GPU ``d``).
  Each bundle is probed once for the GPU id Ray gave it. A worker is scheduled into the bundle of
  its first device and asks Ray for ``1/k`` of it, ``k`` = the roles sharing that device, so Ray's
  accounting refuses oversubscription while colocated actors share. A one-device worker gets its
  GPU from Ray itself (``CUDA_VISIBLE_DEVICES``, ``ray.get_gpu_ids()``). Ray cannot give one actor
  devices from several bundles, so for a multi-device worker flash sets ``CUDA_VISIBLE_DEVICES``
  itself (Ray told not to, ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``; ``ray.get_gpu_ids()``
  is then not meaningful there) to its devices in mapping order; its other devices are held by
  the placement group, so no one else gets them. This is ROLL's scheme. ``FLASH_DEVICES`` carries
  the logical indices for every placed worker. CPU-only roles see no GPU at all.

On CPU, ``ray.init(num_gpus=N)`` simulates N GPUs: the bundles, shares and environment variables are
the same, which is what the tests pin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from fractions import Fraction

from flash.errors import ConfigError

ROLES = ("actor_train", "actor_infer", "reward", "env", "reference", "critic")
# Engines whose worker can release its memory (sleep/wake_up) while a colocated role runs: the
# torch engine drops its KV cache and offloads weights from an accelerator; vLLM uses its sleep mode
# (accelerators only; on CPU it releases nothing and says so). An engine added without them may not
# share devices. The simulated engine holds no memory: it sleeps at once.
SLEEPABLE_ENGINES = ("torch", "vllm", "sim")
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class PlacementError(ConfigError):
    """A device mapping that cannot be placed; the message names the roles and devices in conflict."""


@dataclass
class RoleConfig:
    device_mapping: list[int] = field(default_factory=list)  # device indices; empty = CPU only
    num_workers: int = 1  # devices per worker = len(device_mapping) / num_workers


def _absent() -> RoleConfig:
    return RoleConfig(num_workers=0)


@dataclass
class RolesConfig:
    actor_train: RoleConfig = field(default_factory=RoleConfig)
    actor_infer: RoleConfig = field(default_factory=RoleConfig)  # num_workers = engine replicas
    # Roles whose workers flash starts from their own sections (reward.*, the env task, critic.*)
    # on CPU: planned and checked here, refused by check_runnable.
    reward: RoleConfig = field(default_factory=_absent)
    env: RoleConfig = field(default_factory=_absent)
    # the frozen KL reference (flash.train.reference), one worker; absent: the trainer keeps a copy
    reference: RoleConfig = field(default_factory=_absent)
    critic: RoleConfig = field(default_factory=_absent)


@dataclass
class PlacementConfig:
    # Devices in the Ray cluster flash may use (indices 0..num_gpus-1). A local Ray is started with
    # this many GPUs; on a CPU-only machine they are simulated. 0 = no device mapping at all.
    num_gpus: int = 0
    cpus_per_bundle: float = 0.0  # CPUs reserved beside each device's GPU in its bundle
    roles: RolesConfig = field(default_factory=RolesConfig)


@dataclass(frozen=True)
class Worker:
    role: str
    rank: int
    devices: tuple[int, ...]  # logical device indices, mapping order; () = CPU only
    gpu_share: Fraction  # of its first device's bundle, as Ray accounts it (0 when CPU only)


@dataclass(frozen=True)
class Plan:
    num_gpus: int
    workers: dict[str, tuple[Worker, ...]]  # every role, possibly with no workers
    groups: tuple[tuple[str, ...], ...]  # roles on the same device set, one tuple per device set

    def colocated(self, a: str, b: str) -> bool:
        """Whether roles ``a`` and ``b`` share their devices (and so take turns)."""
        return a != b and any(a in g and b in g for g in self.groups)

    def devices(self, role: str) -> list[int]:
        return sorted({d for w in self.workers[role] for d in w.devices})

    def describe(self) -> str:
        """One line per role, for logs and ``flash validate``."""
        lines = [f"placement: {self.num_gpus} device(s)"]
        for role, ws in self.workers.items():
            if not ws:
                continue
            where = "CPU" if not ws[0].devices else " ".join(f"w{w.rank}:{list(w.devices)}" for w in ws)
            mates = [r for g in self.groups if role in g for r in g if r != role]
            lines.append(
                f"  {role}: {len(ws)} worker(s) {where}" + (f" colocated with {', '.join(mates)}" if mates else "")
            )
        return "\n".join(lines)


# ---- planning (pure) ---------------------------------------------------------------------------
def _role_workers(role: str, rc: RoleConfig, num_gpus: int) -> list[tuple[int, ...]]:
    """Each worker's devices for one role; raises PlacementError naming the role's mistake."""
    where = f"placement.roles.{role}"
    mapping, n = list(rc.device_mapping), rc.num_workers
    if n < 0:
        raise PlacementError(f"{where}.num_workers must be >= 0, got {n}")
    if not mapping:
        return [()] * n
    if n == 0:
        raise PlacementError(
            f"{where} maps devices {mapping} but num_workers is 0; set num_workers or empty device_mapping"
        )
    dups = sorted({d for d in mapping if mapping.count(d) > 1})
    if dups:
        raise PlacementError(
            f"{where}.device_mapping lists device(s) {dups} more than once; "
            f"a worker owns each of its devices, so list each index once"
        )
    bad = [d for d in mapping if not 0 <= d < num_gpus]
    if bad:
        raise PlacementError(
            f"{where}.device_mapping uses device {bad[0]}, outside the "
            f"{num_gpus} device(s) of placement.num_gpus={num_gpus} (valid: 0.."
            f"{num_gpus - 1}); raise placement.num_gpus or change the mapping"
        )
    if len(mapping) % n:
        raise PlacementError(
            f"{where}: {len(mapping)} device(s) {mapping} do not divide among "
            f"num_workers={n}; use a worker count that divides {len(mapping)}"
        )
    d = len(mapping) // n
    return [tuple(mapping[i * d : (i + 1) * d]) for i in range(n)]


def _colocation_groups(sets: dict[str, frozenset[int]]) -> tuple[tuple[str, ...], ...]:
    """Roles grouped by identical device sets; a partial overlap raises PlacementError."""
    roles = list(sets)
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            shared = sets[a] & sets[b]
            if shared and sets[a] != sets[b]:
                raise PlacementError(
                    f"{a} {sorted(sets[a])} and {b} {sorted(sets[b])} share device(s) {sorted(shared)} "
                    f"but not all: roles must map the same devices (colocated, taking turns) or "
                    f"disjoint ones (disaggregated, running at once)"
                )
    groups: dict[frozenset[int], list[str]] = {}
    for role in roles:
        groups.setdefault(sets[role], []).append(role)
    return tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: min(sets[g[0]])))


def plan_placement(cfg: PlacementConfig, engine: str = "torch") -> Plan:
    """Check ``cfg`` and decide every worker's devices; raises PlacementError on any conflict.

    ``engine`` is ``rollout.engine``: an engine that cannot release its memory may not share
    devices with another role.
    """
    if cfg.num_gpus < 0:
        raise PlacementError(f"placement.num_gpus must be >= 0, got {cfg.num_gpus}")
    if cfg.cpus_per_bundle < 0:
        raise PlacementError(f"placement.cpus_per_bundle must be >= 0, got {cfg.cpus_per_bundle}")
    per_role = {f.name: _role_workers(f.name, getattr(cfg.roles, f.name), cfg.num_gpus) for f in fields(RolesConfig)}
    sets = {r: frozenset(d for w in ws for d in w) for r, ws in per_role.items() if ws and ws[0]}
    groups = _colocation_groups(sets)
    for group in groups:
        if "actor_infer" in group and len(group) > 1 and engine not in SLEEPABLE_ENGINES:
            others = ", ".join(r for r in group if r != "actor_infer")
            raise PlacementError(
                f"actor_infer shares devices {sorted(sets['actor_infer'])} with {others}, but engine "
                f"'{engine}' cannot release its memory while they run (only {', '.join(SLEEPABLE_ENGINES)} "
                f"can); use rollout.engine=torch or give actor_infer its own devices"
            )
    sharing = {d: sum(d in s for s in sets.values()) for d in range(cfg.num_gpus)}
    workers = {
        role: tuple(
            Worker(role, i, devs, Fraction(1, sharing[devs[0]]) if devs else Fraction(0)) for i, devs in enumerate(ws)
        )
        for role, ws in per_role.items()
    }
    return Plan(num_gpus=cfg.num_gpus, workers=workers, groups=groups)


# ---- materialising (Ray) -----------------------------------------------------------------------
def _probe_gpu():
    """(GPU ids Ray gave this task, node id): run once per bundle to learn its physical GPU."""
    import ray

    return [str(i) for i in ray.get_gpu_ids()], ray.get_runtime_context().get_node_id()


class Placement:
    """A ``Plan`` made real: the placement group and each worker's Ray actor options."""

    def __init__(self, plan: Plan, pg=None, gpu_ids: list[str] = (), nodes: list[str] = ()):
        self.plan, self.pg = plan, pg
        self.gpu_ids, self.nodes = list(gpu_ids), list(nodes)  # per device index

    @classmethod
    def create(cls, plan: Plan, cpus_per_bundle: float = 0.0, timeout: float = 60.0) -> Placement:
        """Reserve the plan's devices in the running Ray cluster (no-op when the plan has none)."""
        import ray
        from ray.util.placement_group import placement_group

        if plan.num_gpus == 0:
            return cls(plan)
        have = ray.cluster_resources().get("GPU", 0)
        if have < plan.num_gpus:
            raise PlacementError(
                f"placement.num_gpus={plan.num_gpus} but the Ray cluster has {have:g} "
                f"GPU(s); lower placement.num_gpus or join a larger cluster (ray.address)"
            )
        bundle = {"GPU": 1, **({"CPU": cpus_per_bundle} if cpus_per_bundle else {})}
        pg = placement_group([dict(bundle) for _ in range(plan.num_gpus)], strategy="PACK", name="flash-devices")
        if not ray.wait([pg.ready()], timeout=timeout)[0]:
            ray.util.remove_placement_group(pg)
            raise PlacementError(
                f"could not reserve {plan.num_gpus} bundle(s) of {bundle} within {timeout:g} s; "
                f"free resources: {ray.available_resources()}"
            )
        probe = ray.remote(_probe_gpu)
        found = ray.get(
            [
                probe.options(num_cpus=0, num_gpus=1, scheduling_strategy=_strategy(pg, d)).remote()
                for d in range(plan.num_gpus)
            ]
        )
        placement = cls(plan, pg, [g[0] for g, _ in found], [n for _, n in found])
        placement._check_nodes()
        return placement

    def _check_nodes(self) -> None:
        for ws in self.plan.workers.values():
            for w in ws:
                nodes = {self.nodes[d] for d in w.devices}
                if len(nodes) > 1:
                    raise PlacementError(
                        f"{w.role} worker {w.rank} maps devices {list(w.devices)} that Ray "
                        f"placed on {len(nodes)} nodes; one worker's devices must share a node"
                    )

    def options(self, role: str, rank: int) -> dict:
        """Keyword arguments for ``ray.remote(cls).options(...)`` that put this worker in place.

        Merge ``runtime_env`` with care: its ``env_vars`` carry the device assignment.
        """
        w = self.plan.workers[role][rank]
        if self.plan.num_gpus == 0:
            return {}
        if not w.devices:  # a CPU-only role on a machine with GPUs: it must not grab one
            return {"runtime_env": {"env_vars": {NOSET_ENV: "1", "CUDA_VISIBLE_DEVICES": ""}}}
        env = {"FLASH_DEVICES": ",".join(str(d) for d in w.devices)}
        if len(w.devices) > 1:  # Ray would show only the first bundle's GPU: flash sets them all
            env.update({NOSET_ENV: "1", "CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids[d] for d in w.devices)})
        return {
            "num_gpus": float(w.gpu_share),
            "scheduling_strategy": _strategy(self.pg, w.devices[0]),
            "runtime_env": {"env_vars": env},
        }

    def remove(self) -> None:
        if self.pg is not None:
            import ray

            ray.util.remove_placement_group(self.pg)
            self.pg = None


def _strategy(pg, bundle: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


# Roles the runner starts workers for, and how many workers of each it can run today (None: any
# number). actor_train workers are the FSDP2 group's ranks (one rank per worker, train.workers),
# actor_infer workers the engine replicas behind the router, the reference worker the frozen
# initial policy a KL penalty reads.
RUNNABLE = {"actor_train": None, "actor_infer": None, "reference": 1}


def check_runnable(plan: Plan) -> None:
    """Raise PlacementError for a role the runner cannot start, so no mapping is silently unused."""
    for role, ws in plan.workers.items():
        if not ws:
            continue
        if role not in RUNNABLE:
            raise PlacementError(
                f"placement.roles.{role} asks for {len(ws)} worker(s), but flash does not "
                f"place {role} workers yet (any it runs are sized by their own config "
                f"section, on CPU); set placement.roles.{role}.num_workers=0"
            )
        limit = RUNNABLE[role]
        if limit is not None and len(ws) > limit:
            raise PlacementError(
                f"placement.roles.{role}.num_workers={len(ws)}, but this runner starts at most {limit} {role} worker(s)"
            )
    if not plan.workers["actor_train"] or not plan.workers["actor_infer"]:
        raise PlacementError("placement.roles.actor_train and actor_infer each need num_workers >= 1")


# Engines whose worker runs its model on one device; vLLM runs one tensor-parallel rank per device
# of its worker (flash.engine.vllm_parts.device_args), and the simulated engine holds no model.
SINGLE_DEVICE_ENGINES = ("torch",)


def check_engine_devices(plan: Plan, engine: str) -> None:
    """Raise PlacementError when an ``actor_infer`` worker holds devices its engine would not use."""
    wide = [w for w in plan.workers["actor_infer"] if len(w.devices) > 1]
    if engine in SINGLE_DEVICE_ENGINES and wide:
        devices = plan.devices("actor_infer")
        raise PlacementError(
            f"placement.roles.actor_infer gives each worker {len(wide[0].devices)} devices "
            f"(w{wide[0].rank}: {list(wide[0].devices)}), but the {engine} engine runs on one: set "
            f"placement.roles.actor_infer.num_workers={len(devices)} (one replica per device), "
            f"or rollout.engine=vllm (tensor parallel over a worker's devices)"
        )


def visible_devices() -> list[int]:
    """This process's logical device indices, as the placement gave them (empty: CPU only)."""
    raw = os.environ.get("FLASH_DEVICES", "")
    return [int(x) for x in raw.split(",") if x]
