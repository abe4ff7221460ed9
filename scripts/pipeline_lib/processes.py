"""Child processes that must not outlive their parent."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


def parent_death_hook(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """preexec_fn for a child: the kernel sends it `sig` when this process dies, however it dies
    (even by SIGKILL, when no cleanup code runs). Linux only; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook
