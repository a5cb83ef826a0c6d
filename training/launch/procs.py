"""Child processes that die with their parent: the kernel's parent-death signal, armed
before exec (the launcher's torchrun agents and stores, the Lighthouse) or at a worker's
start (torchrun's workers)."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not import


def die_with(launcher: int) -> Callable[[], None]:
    """preexec_fn: the kernel sends SIGKILL to the child when the launcher dies. The
    setting survives exec, including `ip netns exec`'s (which execs the command in place);
    a launcher that died before it was set is caught by the parent check."""

    def arm() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:
            os._exit(1)

    return arm


def die_with_parent() -> None:
    """SIGKILL from the kernel when this process's parent dies (killed with -9, or by its
    own launcher's death); exits at once when the parent died before the signal was set."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        os._exit(1)
