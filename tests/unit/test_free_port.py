"""The test helpers' port picker: ports that a server started later can still bind."""

from __future__ import annotations

import socket

from helpers import private_redis
from helpers.private_redis import free_port


def test_ports_are_distinct_below_the_ephemeral_range_and_bindable() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    ephemeral_start = private_redis._ephemeral_range_start()
    if ephemeral_start - private_redis._LOWEST_PORT >= 1_000:
        assert all(private_redis._LOWEST_PORT <= port < ephemeral_start for port in ports)
    for port in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch) -> None:
    spare = free_port()
    monkeypatch.setattr(private_redis, "_HANDED_OUT", set())
    monkeypatch.setattr(private_redis, "_ephemeral_range_start", lambda: 65_000)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, spare])
        monkeypatch.setattr(private_redis.random, "randrange", lambda low, high: next(picks))
        assert free_port() == spare


def test_pytest_xdist_workers_pick_from_disjoint_slices(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        slices.append(private_redis._worker_slice(10_000, 31_000))
    assert slices == [(10_000, 17_000), (17_000, 24_000), (24_000, 31_000)]
    monkeypatch.setattr(private_redis, "_ephemeral_range_start", lambda: 31_000)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert all(17_000 <= free_port() < 24_000 for _ in range(50))
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert private_redis._worker_slice(10_000, 31_000) == (10_000, 31_000)
