"""The router's in-flight ledger: what routing and admission read about each worker, one entry per
prefill (by request) and per ticket reservation (by ticket), counted once and freed once."""

from __future__ import annotations

from pdserve.router.in_flight import InFlightLedger, PrefillJob, WorkerInFlight


def test_prefills_queue_in_booking_order_and_a_new_booking_moves_the_old_one() -> None:
    ledger = InFlightLedger()
    ledger.book_prefill("a", "p0", 100, 1.0)
    ledger.book_prefill("b", "p0", 50, 2.0)
    assert ledger.on("p0") == WorkerInFlight(num_prefill_tokens=150,
                                             head_prefill=PrefillJob("p0", 100, 1.0))
    ledger.book_prefill("a", "p1", 100, 3.0)  # dispatched elsewhere (a retry)
    assert ledger.on("p0").num_prefill_tokens == 50
    assert ledger.on("p0").head_prefill == PrefillJob("p0", 50, 2.0)
    assert ledger.on("p1").head_prefill == PrefillJob("p1", 100, 3.0)
    assert ledger.end_prefill("a") == PrefillJob("p1", 100, 3.0)
    assert ledger.end_prefill("a") is None  # once only
    assert ledger.on("p1") == WorkerInFlight()


def test_reservations_count_blocks_and_sequences_until_their_ticket_is_released() -> None:
    ledger = InFlightLedger()
    ledger.reserve_blocks("t1", "d0", 30)
    ledger.reserve_blocks("t2", "d0", 12)
    assert (ledger.on("d0").num_reserved_blocks, ledger.on("d0").num_seqs) == (42, 2)
    ledger.release_blocks("t1")
    ledger.release_blocks("t1")  # an attempt that ends twice frees once
    ledger.release_blocks("never-reserved")
    assert (ledger.on("d0").num_reserved_blocks, ledger.on("d0").num_seqs) == (12, 1)


def test_a_late_release_cannot_free_a_later_tickets_blocks() -> None:
    # The same request retried (or a request id reused by the client): each attempt has its own
    # ticket, so the old attempt's cleanup, however late, leaves the new reservation alone.
    ledger = InFlightLedger()
    ledger.reserve_blocks("ticket-old", "d0", 10)
    ledger.reserve_blocks("ticket-new", "d0", 20)
    ledger.release_blocks("ticket-old")
    assert ledger.on("d0") == WorkerInFlight(num_reserved_blocks=20, num_seqs=1)


def test_prefill_and_decode_entries_of_one_worker_are_independent() -> None:
    ledger = InFlightLedger()
    ledger.book_prefill("r", "d0", 64, 0.0)  # local prefill on the decode worker
    ledger.reserve_blocks("t", "d0", 8)
    ledger.end_prefill("r")
    assert ledger.on("d0") == WorkerInFlight(num_reserved_blocks=8, num_seqs=1)
    ledger.release_blocks("t")
    assert ledger.on("d0") == WorkerInFlight()
