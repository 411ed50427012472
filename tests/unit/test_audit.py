"""``pdserve audit``'s reconcile: what it calls leaked, unaccounted, double-counted, a checksum
mismatch and a late write, from the coordinator's ledgers and the workers' own tables."""

from __future__ import annotations

from pdserve.cli.audit import LedgerView, WorkerView, format_report, reconcile


def _decode(
    worker_id: str,
    used: int,
    tokens: dict[str, int],
    checksums: dict[str, int] | None = None,
    late: int = 0,
) -> WorkerView:
    return WorkerView(worker_id, "decode", used, 100, tokens, checksums or {}, late)


def test_matching_ledgers_tables_and_checksums_are_ok() -> None:
    report = reconcile(
        [LedgerView("d1", 100, 4, 6, {"t1:1": 4, "t2:1": 6})],
        [_decode("d1", 10, {"t1:1": 4, "t2:1": 6}, {"t2:1": 7}),
         WorkerView("p1", "prefill", 0, 50, {}, {"t2:1": 7})])
    assert report.is_ok and report.leaked_blocks == 0
    assert report.num_checksums_compared == 1
    assert "audit: OK" in format_report(report)


def test_blocks_the_ledger_counts_but_the_worker_does_not_use_are_leaked() -> None:
    report = reconcile([LedgerView("d1", 100, 8, 0, {"t1:1": 8})], [_decode("d1", 0, {})])
    (row,) = report.decode
    assert (row.leaked_blocks, row.unaccounted_blocks, row.tokens_only_in_ledger) == (
        8,
        0,
        ("t1:1",),
    )
    assert not report.is_ok and report.leaked_blocks == 8


def test_blocks_the_worker_uses_that_the_ledger_does_not_count_are_unaccounted() -> None:
    report = reconcile([LedgerView("d1", 100, 0, 0)], [_decode("d1", 5, {"t9:2": 5})])
    (row,) = report.decode
    assert (row.unaccounted_blocks, row.tokens_only_on_worker) == (5, ("t9:2",))
    assert not report.is_ok


def test_tickets_claiming_more_blocks_than_the_allocator_gave_out_are_double_counted() -> None:
    report = reconcile([LedgerView("d1", 100, 4, 4, {"a:1": 4, "b:1": 4})],
                       [_decode("d1", 4, {"a:1": 4, "b:1": 4})])
    (row,) = report.decode
    assert row.double_counted_blocks == 4 and not report.is_ok


def test_checksum_mismatch_late_write_and_prefill_leak_are_each_reported() -> None:
    workers = [_decode("d1", 0, {}, {"t:1": 1, "u:1": 5}, late=1),
               WorkerView("p1", "prefill", 3, 50, {}, {"t:1": 2, "u:1": 5})]
    report = reconcile([LedgerView("d1", 100, 0, 0)], workers)
    assert report.checksum_mismatches == ("t:1",)
    assert report.late_writes_accepted == 1
    assert report.prefill_blocks_in_use == {"p1": 3}
    assert not report.is_ok
    text = format_report(report)
    assert "checksum mismatch: t:1" in text and "MISMATCH" in text


def test_a_ledger_of_a_worker_that_did_not_answer_is_missing_only_if_it_counts_blocks() -> None:
    idle = reconcile([LedgerView("gone", 100, 0, 0)], [])
    assert idle.is_ok
    busy = reconcile([LedgerView("gone", 100, 3, 0, {"x:1": 3})], [])
    assert not busy.is_ok and busy.decode[0].is_missing


def test_the_report_names_the_tickets_only_one_side_holds() -> None:
    busy = reconcile([LedgerView("gone", 100, 3, 0, {"x:1": 3})], [])
    text = str(busy)
    assert "gone: 1 tickets only in the ledger: x:1" in text
    assert "did not answer" in text and "MISMATCH" in text
