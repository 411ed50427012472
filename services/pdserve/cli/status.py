"""``pdserve status``: pools, workers, tickets and KV use as a table."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pdserve.cli.client_options import add_client_arguments, client_channel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    default = os.environ.get("PDSERVE_ADDRESS", "127.0.0.1:50051")
    parser.add_argument("--address", default=default,
                        help="address serving every service (pdserve up) [PDSERVE_ADDRESS]")
    parser.add_argument(
        "--prefill-pool-address", default=None, help="prefill pool manager, if separate"
    )
    parser.add_argument(
        "--decode-pool-address", default=None, help="decode pool manager, if separate"
    )
    parser.add_argument(
        "--coordinator-address", default=None, help="KV-transfer coordinator, if separate"
    )
    parser.add_argument("--deployment", default="", help="only this deployment")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_status(args))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


async def _status(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.api.v1 import common_pb2 as pb
    from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, pool_pb2, pool_pb2_grpc
    from pdserve.common.grpc_client import error_from_rpc_error

    roles = {pb.WORKER_ROLE_PREFILL: args.prefill_pool_address or args.address,
             pb.WORKER_ROLE_DECODE: args.decode_pool_address or args.address}
    rows = []
    try:
        for role, address in roles.items():
            async with client_channel(address, args) as channel:
                stub = pool_pb2_grpc.PoolServiceStub(channel)
                response = await stub.ListWorkers(
                    pool_pb2.ListWorkersRequest(deployment=args.deployment, role=role), timeout=10)
                for w in response.workers:
                    load = w.load
                    rows.append(
                        [
                            w.deployment,
                            pb.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower(),
                            w.worker_id,
                            pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower(),
                            w.address,
                            str(load.num_queued_prefill_tokens),
                            str(load.num_running_seqs),
                            f"{load.num_free_blocks}/{load.num_total_blocks}",
                            w.software_version or "-",  # "-": a release older than the field
                        ]
                    )
        async with client_channel(args.coordinator_address or args.address, args) as channel:
            coordinator = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
            ledger = await coordinator.GetLedger(
                kv_transfer_pb2.GetLedgerRequest(deployment=args.deployment), timeout=10)
            tickets = await coordinator.ListTickets(
                kv_transfer_pb2.ListTicketsRequest(limit=10_000), timeout=10)
    except grpc.RpcError as exc:
        error = error_from_rpc_error(exc)
        print(f"pdserve status: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    print(_table(["deployment", "role", "worker", "state", "address", "queued_tok", "running",
                  "free/total_blocks", "version"], sorted(rows)))
    print()
    print(_table(["decode_worker", "total", "reserved", "held", "free"], [
        [e.decode_worker_id, str(e.num_total_blocks), str(e.num_reserved_blocks),
         str(e.num_held_blocks), str(e.num_free_blocks)] for e in ledger.entries]))
    by_state: dict[str, int] = {}
    for ticket in tickets.tickets:
        name = pb.TicketState.Name(ticket.state).removeprefix("TICKET_STATE_").lower()
        by_state[name] = by_state.get(name, 0) + 1
    print()
    print("tickets: " + (", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) or "none"))
    return 0
