"""``pdserve governor threshold --deployment D [--pin N | --unpin]``: the local-prefill threshold
the routers apply (its value, where it comes from, the latest decision and its inputs); with
``--pin`` an operator pins it (an admin key on a locked-down stack), with ``--unpin`` the
governor's computed value applies again.

``pdserve governor plan --deployment D [--json]``: the autoscaler's plan in force beside the
governor's latest plan by replay of its observed window (instances and TP per pool, the arrival
model's predicted and the replayed SLO attainment)."""

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
    _add_common(threshold)
    change = threshold.add_mutually_exclusive_group()
    change.add_argument("--pin", type=int, default=None, metavar="TOKENS",
                        help="pin the threshold at TOKENS uncached prompt tokens")
    change.add_argument("--unpin", action="store_true",
                        help="drop the pin: the governor's computed threshold applies again")
    plan = actions.add_parser(
        "plan", help="the autoscaler's plan and the latest plan by replay",
        description="The autoscaler's plan in force beside the governor's latest plan by "
                    "replay of the recent window of observed requests.")
    _add_common(plan)


def _add_common(parser: argparse.ArgumentParser) -> None:
    """What every governor action takes: where the governor is, the deployment, ``--json``."""
    add_client_arguments(parser)
    parser.add_argument("--address", default=os.environ.get("PDSERVE_ADDRESS", "127.0.0.1:50051"),
                        help="governor (or pdserve up) address [PDSERVE_ADDRESS]")
    parser.add_argument("--deployment", required=True, help="the deployment")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_plan(args) if args.action == "plan" else _threshold(args))


async def _plan(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.api.v1 import governor_pb2, governor_pb2_grpc
    from pdserve.common.grpc_client import error_from_rpc_error

    async with client_channel(args.address, args) as channel:
        stub = governor_pb2_grpc.CapacityGovernorServiceStub(channel)
        try:
            response = await stub.GetPlan(
                governor_pb2.GetPlanRequest(deployment=args.deployment), timeout=30)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
    plans = {name: _plan_values(getattr(response, name)) if response.HasField(name) else None
             for name in ("plan", "replayed_plan")}
    if args.json:
        print(json.dumps({"deployment": args.deployment, "autoscaler": plans["plan"],
                          "replayed": plans["replayed_plan"]}, sort_keys=True))
        return 0
    print(_render_plans(args.deployment, plans["plan"], plans["replayed_plan"]))
    return 0


def _plan_values(plan: governor_pb2.Plan) -> dict[str, object]:
    return {
        "prefill": {"instances": plan.num_prefill_instances, "tp": plan.prefill_tp_size},
        "decode": {"instances": plan.num_decode_instances, "tp": plan.decode_tp_size},
        "num_gpus": plan.num_gpus, "made_at": _time(plan.created_unix_ms),
        "arrival_rate_per_s": plan.demand.arrival_rate_per_s,
        "mean_prompt_tokens": plan.demand.prompt.mean_tokens,
        "mean_output_tokens": plan.demand.output.mean_tokens,
        "predicted_attainment": plan.predicted_attainment,
        "replayed_attainment": plan.replayed_attainment,
        "num_requests": plan.num_requests, "window_start": _time(plan.window_start_unix_ms),
        "slo": {"ttft_ms": plan.slo.ttft_ms, "tpot_ms": plan.slo.tpot_ms,
                "percentile": plan.slo.percentile},
    }


def _render_plans(deployment: str, autoscaler: dict[str, object] | None,
                  replayed: dict[str, object] | None) -> str:
    lines = [f"{deployment}:"]
    if autoscaler is None:
        lines.append("  autoscaler: no decision yet")
    else:
        lines.append(f"  autoscaler ({autoscaler['made_at']}): {_pools(autoscaler)}, for "
                     f"{autoscaler['arrival_rate_per_s']:.2f} req/s forecast")
    if replayed is None:
        from pdserve.governor.live_plan import MIN_REQUESTS

        lines.append(f"  by replay: none yet (PDSERVE_LIVE_PLAN_INTERVAL_S; it needs "
                     f"{MIN_REQUESTS} requests in the window)")
        return "\n".join(lines)
    slo = replayed["slo"]
    assert isinstance(slo, dict)
    lines.append(
        f"  by replay ({replayed['made_at']}): {_pools(replayed)}, from "
        f"{replayed['num_requests']} requests since {replayed['window_start']} "
        f"({replayed['arrival_rate_per_s']:.2f} req/s, mean prompt "
        f"{replayed['mean_prompt_tokens']:.0f} tokens)")
    lines.append(
        f"    SLO TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms at "
        f"p{slo['percentile']:g}: predicted {_percent(replayed['predicted_attainment'])}, replayed "
        f"{_percent(replayed['replayed_attainment'])}")
    return "\n".join(lines)


def _pools(values: dict[str, object]) -> str:
    prefill, decode = values["prefill"], values["decode"]
    assert isinstance(prefill, dict) and isinstance(decode, dict)
    return (f"{prefill['instances']} prefill (TP {prefill['tp']}) + {decode['instances']} "
            f"decode (TP {decode['tp']}), {values['num_gpus']} GPUs")


def _percent(value: object) -> str:
    assert isinstance(value, float)
    return f"{value * 100:.1f}%"


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
