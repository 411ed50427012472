"""Which pdserve release this process runs, for operators rolling an upgrade through a fleet.

``software_version()`` is the installed package's version, plus ``+g<commit>`` (and ``.dirty``)
when the package runs from a git checkout: a fleet mid-upgrade shows which processes run what
(workers report it in ``WorkerInfo.software_version``; every service exports it as the
``pdserve_process_build_info`` gauge). Computed once per process (one ``git`` call at most,
with a short timeout); never fails: what it cannot find, it leaves out.
"""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path

_GIT_TIMEOUT_S = 2.0
UNKNOWN_VERSION = "0+unknown"


@functools.cache
def software_version() -> str:
    """``<package version>[+g<12-hex commit>[.dirty]]``, e.g. ``0.1.0+g470412b75fe0``."""
    try:
        version = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        version = UNKNOWN_VERSION
    commit = _git_commit(Path(__file__).resolve().parents[3])
    return f"{version}+g{commit}" if commit else version


def _git_commit(root: Path) -> str:
    """The commit of the pdserve checkout at ``root`` (``.dirty`` if it has changes to tracked
    files); "" when ``root`` is no pdserve checkout (an installed wheel, an extracted archive,
    or a package that merely sits inside some other repository) or there is no git."""
    if not (root / ".git").exists() or not (root / "services" / "pdserve").is_dir():
        return ""
    try:
        result = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty=.dirty", "--abbrev=12",
             "--exclude", "*"],
            capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""
