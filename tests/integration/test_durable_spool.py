"""The durable spool against a private PostgreSQL that the tests stop and start: records wait on
local disk while the database is down, are written in order when it returns, survive a
``kill -9`` of the spooling process (the next writer on the folder adopts them), and a replay of
records that were already written adds nothing (idempotent writes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from helpers.private_postgres import PrivatePostgres, private_postgres

from pdserve.common.types import TicketState, WorkerRole, WorkerState
from pdserve.db import upgrade
from pdserve.db.durable import (
    DurableWriter,
    RecordKind,
    Spool,
    decode_record,
    encode_record,
    spool_folder,
)
from pdserve.db.records import (
    RequestWindowRecord,
    ScalingAction,
    ScalingDecisionRecord,
    TransferStatsRecord,
    WorkerEventRecord,
)
from pdserve.db.repository import Repository

pytestmark = pytest.mark.timeout(120)

T0 = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PrivatePostgres]:
    with private_postgres() as server:
        repository = Repository.from_url(server.url)
        upgrade(repository.engine)
        repository.close()
        yield server


@pytest.fixture
def deployment() -> str:
    return f"spool-{uuid.uuid4().hex[:8]}"


def _event(deployment: str, i: int) -> WorkerEventRecord:
    return WorkerEventRecord(worker_id=f"w-{i}", deployment=deployment, role=WorkerRole.DECODE,
                             to_state=WorkerState.READY, reason=f"event {i}",
                             at=T0 + timedelta(seconds=i))


def _stats(deployment: str, i: int) -> TransferStatsRecord:
    return TransferStatsRecord(ticket_id=f"{deployment}-t{i}", attempt=1, deployment=deployment,
                               prefill_worker_id="p-1", decode_worker_id="d-1", num_blocks=4,
                               num_bytes=1000 + i, transfer_s=0.01, exposed_s=0.001,
                               prefill_compute_s=0.02, outcome=TicketState.DONE,
                               at=T0 + timedelta(seconds=i))


def _window(deployment: str, i: int) -> RequestWindowRecord:
    return RequestWindowRecord(deployment=deployment, window_start=T0 + timedelta(seconds=i),
                               window_s=1.0, num_requests=3, num_ok=3, num_ttft_slo_misses=0,
                               num_tpot_slo_misses=0, num_errors=0, goodput_rps=3.0,
                               source="router-a")


def _decision(deployment: str, i: int) -> ScalingDecisionRecord:
    return ScalingDecisionRecord(deployment=deployment, role=WorkerRole.PREFILL,
                                 num_current_instances=2, num_target_instances=3,
                                 action=ScalingAction.SCALE_UP, reason=f"forecast {i}",
                                 at=T0 + timedelta(seconds=i))


def _counts(url: str, deployment: str) -> tuple[int, int, int, int]:
    repository = Repository.from_url(url)
    try:
        return (len(repository.list_worker_events(deployment=deployment, limit=10_000)),
                len(repository.list_transfer_stats(deployment, limit=10_000)),
                len(repository.list_request_windows(deployment, limit=10_000)),
                len(repository.list_scaling_decisions(deployment, limit=10_000)))
    finally:
        repository.close()


def _submit_all(writer: DurableWriter, deployment: str, num: int) -> None:
    for i in range(num):
        writer.submit_record(RecordKind.WORKER_EVENT, _event(deployment, i))
        writer.submit_record(RecordKind.TRANSFER_STATS, _stats(deployment, i))
        writer.submit_record(RecordKind.REQUEST_WINDOW, _window(deployment, i))
        writer.record_scaling_decision(_decision(deployment, i))


def test_every_kind_of_record_survives_the_spool_codec(deployment: str) -> None:
    for kind, record in ((RecordKind.WORKER_EVENT, _event(deployment, 1)),
                         (RecordKind.TRANSFER_STATS, _stats(deployment, 2)),
                         (RecordKind.REQUEST_WINDOW, _window(deployment, 3)),
                         (RecordKind.SCALING_DECISION, _decision(deployment, 4))):
        line = encode_record(kind, record)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert decode_record(line) == (kind, record)
    with pytest.raises(ValueError):
        decode_record(b'{"kind": "worker_event", "record": {"worker_id": ""}}')


class CountingSpool(Spool):
    """A spool that counts its appends (each one an fsync)."""

    num_appends = 0

    def append(self, lines: list[bytes]) -> None:
        self.num_appends += 1
        super().append(lines)


def test_with_postgres_up_records_are_written_without_touching_the_spool(
        postgres: PrivatePostgres, deployment: str, tmp_path: Path) -> None:
    spool = CountingSpool(tmp_path / "spool", "test")
    writer = DurableWriter(Repository.from_url(postgres.url), spool)
    _submit_all(writer, deployment, 20)
    assert writer.wait_spooled(10.0) and writer.wait_written(30.0)
    assert spool.num_appends == 0 and spool.path.stat().st_size == 0
    assert writer.num_spooled == writer.num_written == 80
    writer.close()
    assert _counts(postgres.url, deployment) == (20, 20, 20, 20)


def test_records_wait_on_disk_while_postgres_is_down_and_are_written_when_it_returns(
        postgres: PrivatePostgres, deployment: str, tmp_path: Path) -> None:
    writer = DurableWriter(Repository.from_url(postgres.url), Spool(tmp_path / "spool", "test"))
    postgres.stop()
    try:
        _submit_all(writer, deployment, 20)
        assert writer.wait_spooled(10.0)
        assert writer.num_written == 0
        assert writer.num_pending == 80
        on_disk = writer.spool.path.read_bytes().splitlines()  # type: ignore[union-attr]
        assert len(on_disk) == 80
        assert [decode_record(line)[1] for line in on_disk[:4]] == [
            _event(deployment, 0), _stats(deployment, 0), _window(deployment, 0),
            _decision(deployment, 0)]
    finally:
        postgres.start()
    assert writer.wait_written(30.0), f"{writer.num_pending} records still pending"
    writer.close()
    assert _counts(postgres.url, deployment) == (20, 20, 20, 20)
    assert not list((tmp_path / "spool").glob("*.spool")), "an empty spool is removed at close"


_CHILD = textwrap.dedent("""
    import sys, time
    from datetime import UTC, datetime, timedelta
    from pathlib import Path
    from pdserve.db.durable import DurableWriter, RecordKind, Spool
    from pdserve.db.records import TransferStatsRecord, WorkerEventRecord
    from pdserve.db.repository import Repository
    from pdserve.common.types import TicketState, WorkerRole, WorkerState

    url, folder, deployment, num = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    writer = DurableWriter(Repository.from_url(url), Spool(folder, "child"))
    for i in range(num):
        writer.submit_record(RecordKind.WORKER_EVENT, WorkerEventRecord(
            worker_id=f"w-{i}", deployment=deployment, role=WorkerRole.PREFILL,
            to_state=WorkerState.DRAINING, reason="child", at=t0 + timedelta(seconds=i)))
        writer.submit_record(RecordKind.TRANSFER_STATS, TransferStatsRecord(
            ticket_id=f"{deployment}-c{i}", attempt=1, deployment=deployment,
            prefill_worker_id="p", decode_worker_id="d", num_blocks=1, num_bytes=1,
            transfer_s=0.0, exposed_s=0.0, prefill_compute_s=0.0, outcome=TicketState.DONE))
    assert writer.wait_spooled(20.0)
    print("spooled", writer.num_spooled, writer.num_written, flush=True)
    time.sleep(600)
""")


def test_records_spooled_by_a_process_killed_with_sigkill_are_written_by_the_next_one(
        postgres: PrivatePostgres, deployment: str, tmp_path: Path) -> None:
    folder = spool_folder(tmp_path, postgres.url)
    postgres.stop()
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, postgres.url, str(folder),
                                  deployment, "25"], stdout=subprocess.PIPE, text=True,
                                 cwd=str(tmp_path))
        try:
            line = child.stdout.readline()  # type: ignore[union-attr]
            assert line.split() == ["spooled", "50", "0"], line
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
        orphans = list(folder.glob("*.spool"))
        assert len(orphans) == 1 and len(orphans[0].read_bytes().splitlines()) == 50
    finally:
        postgres.start()
    # The restarted process (a new writer on the same folder) adopts and writes them.
    writer = DurableWriter(Repository.from_url(postgres.url), Spool(folder, "restarted"))
    try:
        assert writer.wait_written(30.0)
        assert writer.num_adopted == 50
    finally:
        writer.close()
    events, stats, _, _ = _counts(postgres.url, deployment)
    assert (events, stats) == (25, 25)
    assert not orphans[0].exists()


def test_a_live_writers_spool_is_not_adopted(postgres: PrivatePostgres, deployment: str,
                                             tmp_path: Path) -> None:
    postgres.stop()
    try:
        first = DurableWriter(Repository.from_url(postgres.url), Spool(tmp_path, "first"))
        _submit_all(first, deployment, 3)
        assert first.wait_spooled(10.0)
        second = DurableWriter(Repository.from_url(postgres.url), Spool(tmp_path, "second"))
        assert second.wait_spooled(10.0)
        assert second.num_adopted == 0 and first.num_pending == 12
    finally:
        postgres.start()
    assert first.wait_written(30.0)
    first.close()
    second.close()
    assert _counts(postgres.url, deployment) == (3, 3, 3, 3)


def test_replaying_records_that_were_already_written_adds_nothing(
        postgres: PrivatePostgres, deployment: str, tmp_path: Path) -> None:
    writer = DurableWriter(Repository.from_url(postgres.url), Spool(tmp_path, "once"))
    _submit_all(writer, deployment, 5)
    assert writer.wait_written(30.0)
    writer.close()
    assert _counts(postgres.url, deployment) == (5, 5, 5, 5)
    # A process that wrote these and died before truncating its spool left them behind.
    orphan = tmp_path / f"dead-{uuid.uuid4().hex[:6]}.spool"
    orphan.write_bytes(b"".join(
        encode_record(kind, make(deployment, i)) for i in range(5)
        for kind, make in ((RecordKind.WORKER_EVENT, _event), (RecordKind.TRANSFER_STATS, _stats),
                           (RecordKind.REQUEST_WINDOW, _window),
                           (RecordKind.SCALING_DECISION, _decision))) + b'{"kind": "worker_ev')
    replay = DurableWriter(Repository.from_url(postgres.url), Spool(tmp_path, "replay"))
    try:
        assert replay.wait_written(30.0)
        assert replay.num_adopted == 20  # the torn last line is skipped
    finally:
        replay.close()
    assert _counts(postgres.url, deployment) == (5, 5, 5, 5)
