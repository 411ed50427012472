"""``pdserve health ADDRESS``: exit 0 when the gRPC health service at ADDRESS answers SERVING,
1 otherwise (NOT_SERVING, shutting down, unreachable). What container health checks run.

``python -m pdserve.cli.health ADDRESS`` does the same while importing only gRPC (a health check
runs every few seconds in every container: it must cost little).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cli.client_options import add_client_arguments, client_channel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="host:port of a pdserve gRPC server")
    parser.add_argument("--service", default="",
                        help="one service's health (e.g. pdserve.api.v1.RouterService); "
                             "empty = the whole server")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the check")
    add_client_arguments(parser)


async def check(address: str, args: argparse.Namespace) -> str:
    """The serving status's name (``SERVING``, ``NOT_SERVING``, ...), or the gRPC error's code."""
    async with client_channel(address, args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=args.service),
                                        timeout=args.timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def run(args: argparse.Namespace) -> int:
    status = asyncio.run(check(args.address, args))
    print(f"{args.address} {status}")
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve health", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
