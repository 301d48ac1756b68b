"""Process helpers every Ray role shares: a quiet, fast worker environment, loading a model,
starting (or joining) Ray with the driver's import path, and waiting for actors to be ready.

Components (engines, trainers, reward and environment workers) and the app import this; of the
project it imports only ``flash.errors``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch

from flash.errors import ConfigError, raise_terminated

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# OpenMP threads that spin while waiting for a busy core collapse throughput (measured: 2-thread
# decode fell from ~5k to ~0.2-1k tokens/s on a loaded 2-core machine); passive waiting costs
# little on an idle one. Roles that alternate (sync) or overlap (async) both need it.
PERF_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def pinned_threads(threads: int) -> Iterator[int]:
    """Run the block on ``threads`` torch intra-op threads, then give the caller its own back.

    Float sums are reduced in a thread-count-dependent order, so a numeric stage that inherited
    its caller's count would give different numbers in a CLI run and in a process where earlier
    work changed the count (a test session, a notebook). Each stage pins its own from the config.
    """
    caller = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(caller)


def quiet() -> None:
    """No per-process download/loading progress bars or advisory warnings in the run's output."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    quiet()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model


def plugin_paths(modules: list[str]) -> list[str]:
    """Directories the driver imports ``modules`` from, so a worker process can import them too."""
    import importlib.util

    paths = []
    for name in modules:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is not None and spec.origin:
            root = Path(spec.origin).parent
            paths.append(str(root.parent if spec.submodule_search_locations else root))
    return paths


_REAPER = None


def start_reaper() -> None:
    """A watcher (``flash/_reaper.py``, its own session) that kills this driver's leftover Ray
    processes if the driver dies without ``ray.shutdown`` (SIGKILL, OOM). One per driver process
    (it watches all of the driver's descendants, whichever Ray session they belong to). Linux only."""
    global _REAPER
    if _REAPER is not None or not os.path.isdir("/proc/self"):
        return
    import subprocess

    script = str(Path(__file__).with_name("_reaper.py"))
    _REAPER = subprocess.Popen(
        [sys.executable, "-I", script, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def require_ray_auth(address: str | None, environ=os.environ, started: bool = False) -> None:
    """Refuse a local Ray without Ray's token authentication (one line naming the fix).

    A local Ray's GCS, raylets and workers listen on every interface whatever the node address
    (Ray binds its gRPC servers to all of them); with token authentication (Ray >= 2.52, on by
    default for a new local Ray from 2.59, which then sets ``RAY_AUTH_MODE=token``) every one of
    those entry points wants the token Ray keeps in ``~/.ray/auth_token``, so a stranger on the
    network can neither join nor call in. Before ``ray.init``: an explicit other mode is refused
    (setting the variable here would come too late: Ray caches its config at import). After it
    (``started``): the mode must be on. A cluster joined by ``ray.address`` is configured by
    whoever started it (docs/cluster.md)."""
    mode = environ.get("RAY_AUTH_MODE")
    if address or (mode is None and not started) or (mode or "").lower() == "token":
        return
    if started:
        ray.shutdown()
        raise ConfigError(
            "the local Ray started without token authentication (a Ray before 2.59 does not turn it "
            "on by itself): set RAY_AUTH_MODE=token before starting flash"
        )
    raise ConfigError(
        f"RAY_AUTH_MODE={mode}: a local Ray listens on every interface and flash starts it only "
        f"with token authentication; unset RAY_AUTH_MODE (or set it to token)"
    )


def init_ray(address: str | None, num_cpus: int, extra_paths: list[str] = (), num_gpus: int = 0) -> None:
    """Join ``address`` or start a quiet local Ray (token-authenticated: ``require_ray_auth``)
    whose workers see the driver's import path.

    ``num_gpus`` (local Ray only, 0 = Ray's own detection): GPUs to declare; on a CPU-only machine
    they are simulated, which is enough for placement groups (flash.placement).
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray.is_initialized():
        return
    require_ray_auth(address)
    paths = [p for p in [*extra_paths, os.getcwd(), *sys.path] if p and os.path.isdir(p)]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **QUIET_ENV, **PERF_ENV}
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": env},
        logging_level="ERROR",
        configure_logging=True,
    )
    if address:
        ray.init(address=address, **kwargs)
    else:
        # "local": always a new Ray of this driver's own, never one that `ray start` or another
        # tool left registered on this machine (plain ray.init() would join it)
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2, num_gpus=num_gpus or None, **kwargs)
        require_ray_auth(None, started=True)
        start_reaper()
    if threading.current_thread() is threading.main_thread():  # after ray.init: it installs its own
        signal.signal(signal.SIGTERM, raise_terminated)


def wait_ready(*actors, timeout: float = 600.0, names: list[str] | None = None) -> float:
    """Block until every actor answers (model loaded); returns the seconds it took. One that has not
    answered within ``timeout`` raises ``RolesNotReady`` naming it (``names``: one per actor) and
    the knob, ``resources.ready_timeout_s``."""
    from flash.errors import RolesNotReady

    start = time.monotonic()
    refs = [a.stats.remote() for a in actors]
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if waiting:
        late = [(names or [f"actor {i}" for i in range(len(refs))])[refs.index(r)] for r in waiting]
        raise RolesNotReady(
            f"{', '.join(late)} did not answer within {timeout:.0f} s of starting (a model still loading on a "
            "busy machine or a slow disk, or a stuck process): raise resources.ready_timeout_s, or free the machine"
        )
    ray.get(refs)  # an actor that died while starting raises its error here
    return time.monotonic() - start
