"""The ``pdserve`` command line. Every subcommand imports its implementation lazily so that
``pdserve --help`` stays fast and a missing optional dependency only affects its own command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from pdserve.common.errors import PdserveError

# command name -> (module, help). Each module defines ``add_arguments(parser)`` and ``run(args)``.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.cli.up", "run the whole stack on this machine (embedded state, sim workers)"),
    "serve": (
        "pdserve.cli.serve",
        "run one service in this process: router, a pool manager, coordinator, governor, worker",
    ),
    "generate": ("pdserve.cli.generate", "send one prompt to a router and stream the tokens"),
    "status": ("pdserve.cli.status", "pools, workers, tickets and KV use as a table"),
    "db": ("pdserve.cli.db", "database schema: upgrade, current"),
    "tokenizer": ("pdserve.cli.tokenizer_cmd", "export the built-in tokenizer as a folder"),
    "capacity": (
        "pdserve.cli.capacity_cmd",
        "KV-cache capacity per TP size: blocks, tokens, concurrency for a length mix",
    ),
    "plan": (
        "pdserve.cli.plan",
        "prefill and decode instance counts for a demand and SLO, with a P:D sweep plot",
    ),
    "simulate": (
        "pdserve.cli.simulate",
        "replay a trace through a simulated cluster running the live policies",
    ),
    "experts": (
        "pdserve.cli.experts",
        "per-GPU expert load before/after a placement: table and heat map",
    ),
    "governor": (
        "pdserve.cli.governor",
        "operator controls of the governor: the local-prefill threshold (show, pin, unpin), "
        "the plans in force",
    ),
    "audit": (
        "pdserve.cli.audit",
        "reconcile decode ledgers with worker block tables; compare KV block checksums",
    ),
    "certs": ("pdserve.cli.certs", "make a development CA and mutual-TLS certificates"),
    "models": (
        "pdserve.cli.models",
        "build model folders offline: SmolLM2-135M-Instruct, a tiny random Llama",
    ),
    "doctor": (
        "pdserve.cli.doctor",
        "check (and --fix) that this environment can run the vllm engine",
    ),
    "health": ("pdserve.cli.health", "exit 0 when a service's gRPC health is SERVING (probes)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Control plane for LLM serving with disaggregated prefill and decode pools.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def _is_vllm_worker(words: Sequence[str]) -> bool:
    for index, word in enumerate(words):
        if word == "--engine" and index + 1 < len(words):
            return words[index + 1] == "vllm"
        if word.startswith("--engine="):
            return word.partition("=")[2] == "vllm"
    return os.environ.get("PDSERVE_ENGINE") == "vllm"


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:2] == ["serve", "worker"] and not _is_vllm_worker(words):
        # Engines compute with numpy: one BLAS thread per worker, set before numpy loads, keeps
        # the tiny engine's KV bytes independent of the thread count (and is faster here).
        # vLLM sizes and pins its own OpenMP threads (an OMP_NUM_THREADS set here overrides
        # that, and two engines then spin on the same cores).
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return int(run(args) or 0)
    except PdserveError as exc:
        print(f"pdserve {args.command}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
