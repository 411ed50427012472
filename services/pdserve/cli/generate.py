"""``pdserve generate "prompt"``: stream one completion from a router over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pdserve.cli.client_options import add_client_arguments, client_channel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument(
        "--address",
        default=os.environ.get("PDSERVE_ROUTER_ADDRESS", "127.0.0.1:50051"),
        help="router gRPC address [PDSERVE_ROUTER_ADDRESS; default 127.0.0.1:50051]",
    )
    parser.add_argument("--model", default=os.environ.get("PDSERVE_MODEL", ""),
                        help="model name [PDSERVE_MODEL; default: the only one served]")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate (default 32)"
    )
    parser.add_argument("--prefill-mode", choices=("auto", "remote", "local"), default="auto")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of the call")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.api.v1 import common_pb2 as pb
    from pdserve.api.v1 import router_pb2, router_pb2_grpc
    from pdserve.common.grpc_client import error_from_rpc_error

    modes = {"auto": pb.PREFILL_MODE_UNSPECIFIED, "remote": pb.PREFILL_MODE_REMOTE,
             "local": pb.PREFILL_MODE_LOCAL}
    async with client_channel(args.address, args) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        model = args.model
        try:
            if not model:
                models = await stub.ListModels(router_pb2.ListModelsRequest(), timeout=10)
                if len(models.models) != 1:
                    names = ", ".join(m.name for m in models.models) or "none"
                    print(
                        f"pdserve generate: --model is required (served: {names})", file=sys.stderr
                    )
                    return 2
                model = models.models[0].name
            call = stub.Generate(router_pb2.GenerateRequest(
                model=model, prompt=args.prompt, include_text=True,
                sampling=pb.SamplingParams(max_tokens=args.max_tokens),
                prefill_mode=modes[args.prefill_mode]), timeout=args.timeout_s)
            last = None
            async for chunk in call:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as exc:
            error = error_from_rpc_error(exc)
            print(f"\npdserve generate: {error.code.name}: {error.message}", file=sys.stderr)
            return 1
    print()
    if last is not None and last.HasField("timing"):
        timing = last.timing
        where = "local prefill" if timing.is_local_prefill else f"prefill {last.prefill_worker_id}"
        print(f"[{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} tokens; "
              f"TTFT {timing.ttft_ms:.1f} ms, TPOT {timing.tpot_ms:.2f} ms; {where}, "
              f"decode {last.decode_worker_id}]", file=sys.stderr)
    return 0
