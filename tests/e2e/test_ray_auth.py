"""A local Ray authenticates whoever calls in: its GCS, raylets and workers listen on every
interface, so flash starts it only with Ray's token authentication (``flash.cluster.require_ray_auth``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flash.cluster import require_ray_auth
from flash.errors import ConfigError

JOIN = "import ray, sys; ray.init(address=sys.argv[1], include_dashboard=False); print('JOINED', flush=True)"


def test_a_local_ray_without_token_auth_is_refused_by_name():
    require_ray_auth(None, {})  # unset: Ray turns it on for a new local cluster, checked after the start
    require_ray_auth(None, {"RAY_AUTH_MODE": "token"})
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=disabled: a local Ray listens on every interface.*unset"):
        require_ray_auth(None, {"RAY_AUTH_MODE": "disabled"})
    require_ray_auth("10.1.2.3:6379", {"RAY_AUTH_MODE": "disabled"})  # a joined cluster is its owner's to set
    with pytest.raises(ConfigError, match="started without token authentication.*set RAY_AUTH_MODE=token"):
        require_ray_auth(None, {}, started=True)  # a Ray that did not turn it on by itself
    require_ray_auth(None, {"RAY_AUTH_MODE": "token"}, started=True)


def _join(address: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", JOIN, address],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.slow  # ~15 s: a local Ray, a refused process and a joining one
def test_a_stranger_without_the_runs_token_cannot_join_the_local_ray():
    import ray

    from flash.cluster import init_ray

    started = not ray.is_initialized()
    init_ray(None, 1)
    try:
        assert os.environ["RAY_AUTH_MODE"] == "token"  # checked by init_ray after the start
        address = ray._private.worker.global_worker.node.gcs_address
        host = address.rsplit(":", 1)[0]
        # (two connection attempts instead of Ray's twenty: the refusal is the same on each)
        stranger = _join(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="f" * 32, RAY_gcs_server_port_wait_time_s="2")
        assert stranger.returncode != 0 and "JOINED" not in stranger.stdout
        assert "Failed to connect" in stranger.stderr or "nauthenticated" in stranger.stderr
        member = _join(address)  # the run's own token (Ray keeps it in ~/.ray/auth_token): joins
        assert member.returncode == 0 and "JOINED" in member.stdout, member.stderr[-2000:]
        print(f"GCS at {host} (loopback: {host.startswith('127.')})")
    finally:
        if started:
            ray.shutdown()
