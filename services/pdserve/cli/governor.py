"""``pdserve governor threshold --deployment D [--pin N | --unpin]``: the local-prefill threshold
the routers apply (its value, where it comes from, the latest decision and its inputs); with
``--pin`` an operator pins it (an admin key on a locked-down stack), with ``--unpin`` the
governor's computed value applies again."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
from typing import TYPE_CHECKING

from pdserve.cli.client_options import add_client_arguments, client_channel

if TYPE_CHECKING:
    from pdserve.api.v1 import governor_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    threshold = actions.add_parser(
        "threshold", help="show, pin or unpin a deployment's local-prefill threshold",
        description="The local-prefill threshold the routers apply: prompts with at most this "
                    "many uncached tokens prefill on the decode worker.")
    add_client_arguments(threshold)
    threshold.add_argument("--address", default=os.environ.get("PDSERVE_ADDRESS",
                                                               "127.0.0.1:50051"),
                           help="governor (or pdserve up) address [PDSERVE_ADDRESS]")
    threshold.add_argument("--deployment", required=True, help="the deployment")
    change = threshold.add_mutually_exclusive_group()
    change.add_argument("--pin", type=int, default=None, metavar="TOKENS",
                        help="pin the threshold at TOKENS uncached prompt tokens")
    change.add_argument("--unpin", action="store_true",
                        help="drop the pin: the governor's computed threshold applies again")
    threshold.add_argument("--json", action="store_true", help="print the answer as JSON")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_threshold(args))


async def _threshold(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.api.v1 import governor_pb2, governor_pb2_grpc
    from pdserve.common.errors import InvalidArgumentError
    from pdserve.common.grpc_client import error_from_rpc_error

    if args.pin is not None and args.pin < 0:
        raise InvalidArgumentError(f"--pin: must be >= 0 tokens, got {args.pin}", field="pin")
    async with client_channel(args.address, args) as channel:
        stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
        try:
            if args.pin is not None or args.unpin:
                response = await stub.SetLocalPrefillThreshold(
                    governor_pb2.SetLocalPrefillThresholdRequest(
                        deployment=args.deployment, is_pinned=args.pin is not None,
                        pin_threshold_tokens=args.pin or 0), timeout=30)
            else:
                response = await stub.GetLocalPrefillThreshold(
                    governor_pb2.GetLocalPrefillThresholdRequest(deployment=args.deployment),
                    timeout=30)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
    print(_render(response.threshold, as_json=args.json))
    return 0


def _time(unix_ms: int) -> str:
    return datetime.datetime.fromtimestamp(unix_ms / 1000, datetime.UTC).isoformat(
        timespec="seconds") if unix_ms else ""


def _render(t: governor_pb2.LocalPrefillThreshold, *, as_json: bool) -> str:
    from pdserve.api.v1 import governor_pb2 as pb

    inputs = json.loads(t.inputs_json) if t.inputs_json else {}
    source = pb.ThresholdSource.Name(t.source).removeprefix("THRESHOLD_SOURCE_").lower()
    values = {
        "deployment": t.deployment,
        "threshold_tokens": t.threshold_tokens if t.is_published else None,
        "source": source if t.is_published else "router setting",
        "version": t.version,
        "published_at": _time(t.published_unix_ms),
        "computed_tokens": t.computed_threshold_tokens if t.has_computed else None,
        "reason": t.reason,
        "decided_at": _time(t.decided_unix_ms),
        "inputs": inputs,
    }
    if as_json:
        return json.dumps(values, sort_keys=True)
    if t.is_published:
        head = (f"{t.deployment}: local-prefill threshold {t.threshold_tokens} tokens ({source}, "
                f"version {t.version}, published {values['published_at']})")
    else:
        head = (f"{t.deployment}: no threshold published; the routers apply their own setting "
                f"(PDSERVE_LOCAL_PREFILL_THRESHOLD_TOKENS)")
    lines = [head]
    if t.decided_unix_ms:
        computed = f"; computed {t.computed_threshold_tokens} tokens" if t.has_computed else ""
        lines.append(f"latest decision {values['decided_at']}: {t.reason}{computed}")
    lines.extend(f"  {key} = {inputs[key]}" for key in sorted(inputs))
    return "\n".join(lines)
