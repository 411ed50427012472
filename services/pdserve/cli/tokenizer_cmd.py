"""``pdserve tokenizer export DIR``: the built-in tokenizer as a Hugging Face tokenizer folder,
so OpenAI-HTTP load generators (aiperf, guidellm) can count tokens exactly as the router does."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("export",), help="what to do")
    parser.add_argument("directory", help="folder to write tokenizer.json and its config into")


def run(args: argparse.Namespace) -> int:
    from pdserve.common.tokenizer import export

    path = export(args.directory)
    print(f"tokenizer written to {path}")
    return 0
