"""``pdserve audit``: an independent check of KV accounting and of the KV that crossed the wire.

It asks each party for its own view and compares them, trusting none:

- every decode worker's **ledger** at the coordinator (blocks reserved and held, ``GetLedger``;
  the tickets that count on it, ``ListTickets``) against the **worker's own block table**
  (``WorkerAgentService.GetStatus``: its allocator's blocks in use and the blocks of each ticket
  it has work for). Blocks the ledger counts that the worker does not use are *leaked* (capacity
  nobody can use); blocks the worker uses that the ledger does not count are *unaccounted* (the
  ledger could promise them twice); a worker whose tickets claim more blocks than its allocator
  handed out *double-counts*;
- the **checksum** of every handoff's prompt KV as the prefill side sent it against the decode
  side's checksum of what it accepted (bounded recent history on each worker);
- every decode worker's count of KV frames that landed after their ticket ended (fencing).

A stack under load has transient differences (a ticket opened but not yet admitted), so the
audit repeats until clean or ``--settle-s`` passes, then prints a table and exits 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

# Ticket states that still count blocks on a decode worker's ledger (DONE counts while held).
_COUNTING_STATES = ("OPEN", "PREFILLING", "TRANSFERRING")


@dataclass(frozen=True, slots=True)
class LedgerView:
    """The coordinator's count for one decode worker."""

    worker_id: str
    num_total_blocks: int
    num_reserved_blocks: int
    num_held_blocks: int
    token_to_blocks: dict[str, int] = field(default_factory=dict)
    """Tickets that count on this ledger now (open ones and held DONE ones)."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker's own view (GetStatus)."""

    worker_id: str
    role: str
    num_used_blocks: int
    num_total_blocks: int
    token_to_blocks: dict[str, int] = field(default_factory=dict)
    checksums: dict[str, int] = field(default_factory=dict)
    """Fencing token -> CRC-32 of the prompt KV sent (prefill) or accepted (decode)."""
    num_late_writes_accepted: int = 0
    num_refused_frames: int = 0


@dataclass(frozen=True, slots=True)
class DecodeAudit:
    worker_id: str
    ledger_used_blocks: int
    worker_used_blocks: int
    ticket_blocks: int
    leaked_blocks: int
    unaccounted_blocks: int
    double_counted_blocks: int
    tokens_only_in_ledger: tuple[str, ...]
    tokens_only_on_worker: tuple[str, ...]
    num_late_writes_accepted: int
    is_missing: bool = False
    """The ledger has an entry but the worker did not answer (or the reverse)."""

    @property
    def is_ok(self) -> bool:
        return not (self.leaked_blocks or self.unaccounted_blocks or self.double_counted_blocks
                    or self.tokens_only_in_ledger or self.tokens_only_on_worker
                    or self.num_late_writes_accepted or self.is_missing)


@dataclass(frozen=True, slots=True)
class AuditReport:
    decode: tuple[DecodeAudit, ...]
    prefill_blocks_in_use: dict[str, int]
    """Prefill workers whose allocator has blocks in use with no job (leaks on the sender)."""
    num_checksums_compared: int
    checksum_mismatches: tuple[str, ...]
    """Fencing tokens whose sent and accepted checksums differ."""

    @property
    def leaked_blocks(self) -> int:
        return sum(d.leaked_blocks for d in self.decode) + sum(self.prefill_blocks_in_use.values())

    @property
    def late_writes_accepted(self) -> int:
        return sum(d.num_late_writes_accepted for d in self.decode)

    @property
    def is_ok(self) -> bool:
        return all(d.is_ok for d in self.decode) and not self.prefill_blocks_in_use \
            and not self.checksum_mismatches

    def __str__(self) -> str:
        return format_report(self)


def reconcile(ledgers: list[LedgerView], workers: list[WorkerView]) -> AuditReport:
    """Pure: compare the coordinator's ledgers with the workers' own tables and checksums."""
    decode_workers = {w.worker_id: w for w in workers if w.role == "decode"}
    audits = []
    for ledger in ledgers:
        worker = decode_workers.get(ledger.worker_id)
        ledger_used = ledger.num_reserved_blocks + ledger.num_held_blocks
        if worker is None:
            audits.append(DecodeAudit(ledger.worker_id, ledger_used, 0, 0, ledger_used, 0, 0,
                                      tuple(sorted(ledger.token_to_blocks)), (), 0,
                                      is_missing=ledger_used > 0))
            continue
        ticket_blocks = sum(worker.token_to_blocks.values())
        audits.append(DecodeAudit(
            worker_id=ledger.worker_id, ledger_used_blocks=ledger_used,
            worker_used_blocks=worker.num_used_blocks, ticket_blocks=ticket_blocks,
            leaked_blocks=max(0, ledger_used - worker.num_used_blocks),
            unaccounted_blocks=max(0, worker.num_used_blocks - ledger_used),
            double_counted_blocks=max(0, ticket_blocks - worker.num_used_blocks),
            tokens_only_in_ledger=tuple(sorted(set(ledger.token_to_blocks)
                                               - set(worker.token_to_blocks))),
            tokens_only_on_worker=tuple(sorted(set(worker.token_to_blocks)
                                               - set(ledger.token_to_blocks))),
            num_late_writes_accepted=worker.num_late_writes_accepted,
        ))
    for worker_id, worker in decode_workers.items():
        if worker_id not in {ledger.worker_id for ledger in ledgers} and worker.num_used_blocks:
            audits.append(DecodeAudit(worker_id, 0, worker.num_used_blocks,
                                      sum(worker.token_to_blocks.values()), 0,
                                      worker.num_used_blocks, 0, (),
                                      tuple(sorted(worker.token_to_blocks)),
                                      worker.num_late_writes_accepted, is_missing=True))
    prefill_in_use = {w.worker_id: w.num_used_blocks - sum(w.token_to_blocks.values())
                      for w in workers if w.role == "prefill"}
    sent: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for worker in workers:
        (sent if worker.role == "prefill" else accepted).update(worker.checksums)
    compared = sent.keys() & accepted.keys()
    return AuditReport(
        decode=tuple(audits),
        prefill_blocks_in_use={k: v for k, v in prefill_in_use.items() if v > 0},
        num_checksums_compared=len(compared),
        checksum_mismatches=tuple(sorted(t for t in compared if sent[t] != accepted[t])),
    )


# -- gathering ----------------------------------------------------------------------------------


async def gather(coordinator_address: str, pool_addresses: list[str], deployment: str,
                 timeout_s: float = 10.0) -> tuple[list[LedgerView], list[WorkerView]]:
    """Ledgers from the coordinator, the worker list from the pool managers, and each worker's
    own status. A worker that does not answer is left out (its ledger then shows as missing)."""
    import grpc

    from pdserve.api.v1 import common_pb2 as pb
    from pdserve.api.v1 import (
        kv_transfer_pb2,
        kv_transfer_pb2_grpc,
        pool_pb2,
        pool_pb2_grpc,
        worker_pb2,
        worker_pb2_grpc,
    )
    from pdserve.common.convert import token_from_pb
    from pdserve.common.grpc_client import channel_target

    def insecure(address: str) -> grpc.aio.Channel:
        target, options = channel_target(address)  # replica lists balance over the replicas
        return grpc.aio.insecure_channel(target, options=options or None)

    async with insecure(coordinator_address) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        ledger = await stub.GetLedger(kv_transfer_pb2.GetLedgerRequest(deployment=deployment),
                                      timeout=timeout_s)
        tickets = await stub.ListTickets(kv_transfer_pb2.ListTicketsRequest(limit=100_000),
                                         timeout=timeout_s)
    counting: dict[str, dict[str, int]] = {}
    for ticket in tickets.tickets:
        state = pb.TicketState.Name(ticket.state).removeprefix("TICKET_STATE_")
        if state in _COUNTING_STATES or (state == "DONE" and ticket.is_held):
            counting.setdefault(ticket.decode_worker_id, {})[
                str(token_from_pb(ticket.token))] = ticket.num_blocks
    ledgers = [LedgerView(e.decode_worker_id, e.num_total_blocks, e.num_reserved_blocks,
                          e.num_held_blocks, counting.get(e.decode_worker_id, {}))
               for e in ledger.entries]
    infos = {}
    for address in pool_addresses:
        async with insecure(address) as channel:
            response = await pool_pb2_grpc.PoolServiceStub(channel).ListWorkers(
                pool_pb2.ListWorkersRequest(deployment=deployment), timeout=timeout_s)
        for info in response.workers:
            if info.state not in (pb.WORKER_STATE_FAILED, pb.WORKER_STATE_DRAINED):
                infos[info.worker_id] = info

    async def status(info: pb.WorkerInfo) -> WorkerView | None:
        try:
            async with grpc.aio.insecure_channel(info.address) as channel:
                reply = await worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
                    worker_pb2.GetStatusRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None
        role = "decode" if info.role == pb.WORKER_ROLE_DECODE else "prefill"
        return WorkerView(
            worker_id=info.worker_id, role=role, num_used_blocks=reply.num_used_blocks,
            num_total_blocks=reply.num_total_blocks,
            token_to_blocks={str(token_from_pb(t.token)): t.num_blocks for t in reply.tickets
                             if role == "decode"},
            checksums={str(token_from_pb(c.token)): c.crc32 for c in reply.kv_checksums},
            num_late_writes_accepted=reply.num_late_writes_accepted,
            num_refused_frames=reply.num_refused_frames,
        )

    views = await asyncio.gather(*(status(info) for info in infos.values()))
    return ledgers, [v for v in views if v is not None]


async def audit(coordinator_address: str, pool_addresses: list[str], deployment: str = "",
                settle_s: float = 10.0) -> AuditReport:
    """Gather and reconcile until clean or ``settle_s`` passes; the last report."""
    deadline = time.monotonic() + settle_s
    while True:
        report = reconcile(*await gather(coordinator_address, pool_addresses, deployment))
        if report.is_ok or time.monotonic() >= deadline:
            return report
        await asyncio.sleep(0.25)


# -- command ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator-address",
                        default=os.environ.get("PDSERVE_COORDINATOR_ADDRESS", "127.0.0.1:50051"),
                        help="KV-transfer coordinator [PDSERVE_COORDINATOR_ADDRESS]")
    parser.add_argument("--pool-address", action="append", default=None,
                        help="a pool manager (repeat for prefill and decode; default: the "
                        "coordinator's address, as in pdserve up)")
    parser.add_argument("--deployment", default="", help="only this deployment")
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="repeat until clean for this long (transient in-flight differences)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    import grpc

    pools = args.pool_address or [args.coordinator_address]
    try:
        report = asyncio.run(audit(args.coordinator_address, pools, args.deployment,
                                   args.settle_s))
    except grpc.RpcError as exc:
        print(f"pdserve audit: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(report), "is_ok": report.is_ok}))
    else:
        print(format_report(report))
    return 0 if report.is_ok else 1


def format_report(report: AuditReport) -> str:
    headers = ["decode worker", "ledger used", "worker used", "ticket blocks", "leaked",
               "unaccounted", "double", "only ledger", "only worker", "late writes", "ok"]
    rows = [[d.worker_id, str(d.ledger_used_blocks), str(d.worker_used_blocks),
             str(d.ticket_blocks), str(d.leaked_blocks), str(d.unaccounted_blocks),
             str(d.double_counted_blocks), str(len(d.tokens_only_in_ledger)),
             str(len(d.tokens_only_on_worker)), str(d.num_late_writes_accepted),
             "yes" if d.is_ok else "NO"] for d in report.decode]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for d in report.decode:
        for what, tokens in (("only in the ledger", d.tokens_only_in_ledger),
                             ("only on the worker", d.tokens_only_on_worker)):
            if tokens:
                lines.append(f"{d.worker_id}: {len(tokens)} tickets {what}: "
                             + ", ".join(tokens[:10]) + (" ..." if len(tokens) > 10 else ""))
        if d.is_missing:
            lines.append(f"{d.worker_id}: in the ledger but did not answer (or the reverse)")
    for worker_id, num in report.prefill_blocks_in_use.items():
        lines.append(f"prefill worker {worker_id}: {num} blocks in use with no job")
    lines.append(f"checksums compared: {report.num_checksums_compared}, "
                 f"mismatched: {len(report.checksum_mismatches)}")
    for token in report.checksum_mismatches[:10]:
        lines.append(f"  checksum mismatch: {token}")
    lines.append("audit: " + ("OK" if report.is_ok else "MISMATCH"))
    return "\n".join(lines)
