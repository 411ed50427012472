"""The governor runs active/standby on a Redis lease: of two replicas one holds the lease and
runs the autoscaler; kill -9 of the active one and the standby takes over within a few lease
periods (and only it makes decisions from then on)."""

from __future__ import annotations

import time

import pytest
import redis

from .conftest import ServiceProcess
from .faults import MODEL, kill9, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

LEASE_S = 1.0
LEASE_KEY = "pdserve:lease:{governor}"


def _holder(client: redis.Redis) -> str:
    value = client.get(LEASE_KEY)
    return value.decode().partition("|")[2] if value else ""


def test_a_standby_governor_takes_over_when_the_active_one_is_killed(
        e2e_redis_url: str, e2e_database_url: str, processes: list[ServiceProcess]) -> None:
    env = {"PDSERVE_REDIS_URL": e2e_redis_url, "PDSERVE_DATABASE_URL": e2e_database_url,
           "PDSERVE_LOG_FORMAT": "text", "PDSERVE_METRICS_PORT": "-1"}
    args = ["serve", "governor", "--autoscale-deployments", MODEL, "--is-autoscaler-dry-run",
            "--autoscale-interval-s", "0.5", "--leader-lease-s", str(LEASE_S)]
    governors = [ServiceProcess(f"governor-{i}", args, env) for i in range(2)]
    for governor in governors:
        processes.append(governor.start())
    for governor in governors:
        governor.wait_ready()
    client = redis.Redis.from_url(e2e_redis_url)
    try:
        assert wait_until(lambda: _holder(client), 10.0)
        by_pid = {str(g.pid): g for g in governors}
        active = by_pid[_holder(client).split(":")[1]]
        standby = next(g for g in governors if g is not active)
        assert "is the leader" in active.output and "is the leader" not in standby.output

        killed_at = time.monotonic()
        kill9(active)
        assert wait_until(lambda: _holder(client).split(":")[1:2] == [str(standby.pid)],
                          10 * LEASE_S, 0.05), f"no takeover\n{standby.describe()}"
        takeover_s = time.monotonic() - killed_at
        print(f"governor takeover after {takeover_s:.2f}s (lease {LEASE_S}s)")
        assert takeover_s < 3 * LEASE_S + 1.0
        standby.wait_for_line(lambda line: "is the leader" in line, 5.0, "leadership")
        assert standby.returncode is None
    finally:
        client.close()
