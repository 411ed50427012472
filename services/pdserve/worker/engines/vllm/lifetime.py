"""vLLM's processes die with the agent that started them, however it dies (``kill -9`` too).

vLLM runs EngineCore and its model worker in processes of their own. A parent killed with
SIGKILL cannot stop them, so each of them asks the kernel for SIGKILL when its parent goes
(Linux ``PR_SET_PDEATHSIG``), from its first moment:

- forked children (vLLM's default on CPU): ``os.register_at_fork`` runs the request in every
  child the agent forks, and in their children (the hook is inherited);
- spawned children: vLLM loads its general plugins first thing in EngineCore and in every
  worker; pdserve registers one (entry point ``vllm.general_plugins``: ``plugin``) that makes
  the request when the agent asked for it (``PDSERVE_VLLM_DIE_WITH_PARENT=1`` in the
  environment the children inherit).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
ENVIRONMENT_FLAG = "PDSERVE_VLLM_DIE_WITH_PARENT"
_is_hook_installed = False


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere a warning)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("PR_SET_PDEATHSIG failed: errno %d", ctypes.get_errno())
            return
    except (OSError, AttributeError):
        logger.warning("PR_SET_PDEATHSIG unavailable: engine processes may outlive the agent")
        return
    if os.getppid() == 1:  # the parent died before the call above
        os.kill(os.getpid(), signal.SIGKILL)


def children_die_with_this_process() -> None:
    """From now on every process forked or spawned from here (and theirs) dies with its
    parent. Idempotent."""
    global _is_hook_installed
    os.environ[ENVIRONMENT_FLAG] = "1"
    if not _is_hook_installed:
        os.register_at_fork(after_in_child=die_with_parent)
        _is_hook_installed = True


def plugin() -> None:
    """vLLM general plugin (loaded in each of its processes): see the module's docstring."""
    if os.environ.get(ENVIRONMENT_FLAG) == "1":
        die_with_parent()
