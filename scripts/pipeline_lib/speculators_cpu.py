"""Run speculators' own trainer on a machine without an accelerator.

speculators 0.9.0 assumes a CUDA device at exactly four points of its training loop, and a
fifth when it runs under torchrun (several processes). Each patch below redirects one of them
to the CPU and nothing else; the training loop, loss, optimizer,
checkpointing and resume logic stay speculators' own. They touch 0.9.0 internals, so apply()
refuses any other version instead of patching code it has not been checked against.

CPU also needs settings that are not patches (checked by train_draft.py): attention `sdpa` or
`eager` (FlexAttention has no CPU backward), loss `eager` (the fused loss needs Triton) and
0 dataloader workers."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import time

from .errors import PipelineError

SUPPORTED_VERSION = "0.9.0"
_APPLIED_MARK = "_pipeline_cpu_shims"


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version() -> None:
    found = installed_version()
    if found != SUPPORTED_VERSION:
        raise PipelineError(
            f"CPU training patches speculators {SUPPORTED_VERSION} internals, but "
            f"{'speculators ' + found if found else 'no speculators'} is installed; install "
            f"speculators=={SUPPORTED_VERSION} (envs/cpu.txt) or train on a CUDA machine"
        )


class _CpuStepTimer:
    """speculators' _StepTimer without `torch.accelerator.synchronize()` (point 3): that call
    raises `Cannot access accelerator device` on a CPU-only torch. CPU work is synchronous, so
    plain wall-clock marks are already exact; the profile arithmetic is inherited."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._marks: dict[str, float] = {}
        self._memory: dict[str, float] = {}

    def reset(self, enabled: bool) -> None:
        self.enabled = enabled
        self._marks.clear()
        self._memory.clear()

    def mark(self, name: str) -> None:
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def mark_value(self, name: str, value: float) -> None:
        if self.enabled:
            self._marks[name] = value

    def now(self) -> float | None:
        return time.perf_counter() if self.enabled else None


def _setup_distributed_on_cpu(sp_size: int = 1) -> None:
    """speculators' maybe_setup_distributed (0.9.0) for processes without an accelerator: the
    same topology state and process groups, over gloo instead of the device's backend."""
    import torch.distributed as dist
    from speculators.train import distributed

    distributed._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    distributed._is_distributed = "LOCAL_RANK" in os.environ
    if not distributed._is_distributed:
        return
    dist.init_process_group("gloo")
    distributed._rank = dist.get_rank()
    distributed._world_size = dist.get_world_size()
    distributed._init_sp_process_groups(distributed._rank, distributed._world_size, sp_size)
    distributed.logger.info(f"Started distributed on CPU (gloo) with local_rank={distributed._local_rank}, "
                            f"dp_size={distributed.get_dp_size()}, sp_size={distributed.get_sp_size()}",
                            extra={"override_rank0_filter": True})


def apply() -> list[str]:
    """Patch speculators' trainer for CPU; idempotent. Returns what was redirected."""
    check_version()
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    patched = [
        "trainer.get_local_rank -> 'cpu'",
        "Trainer.device_type -> 'cpu'",
        "trainer._StepTimer -> no accelerator synchronize",
        "checkpointer.get_current_device -> 'cpu'",
        "cli.maybe_setup_distributed -> gloo process group (torchrun on CPU)",
    ]
    if getattr(trainer.Trainer, _APPLIED_MARK, False):
        return patched

    # 1. The Trainer moves the model and every batch to `local_rank` (int 0 = "cuda:0").
    trainer.get_local_rank = lambda: "cpu"

    # 2. Autocast device: Trainer.__init__ falls back to "cuda" when no accelerator exists,
    #    which silently disables autocast and then fails on bf16 hidden states vs fp32 weights.
    original_init = trainer.Trainer.__init__

    @functools.wraps(original_init)
    def init_on_cpu(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_on_cpu

    # 3. The step timer's accelerator synchronize (see _CpuStepTimer; inherit its profile()).
    trainer._StepTimer = type("_StepTimer", (_CpuStepTimer,), {"profile": trainer._StepTimer.profile})

    # 4. The checkpointer loads weights/optimizer state onto the "current device", which it
    #    reports as "cuda:0" without an accelerator; resume would fail on load.
    checkpointer.get_current_device = lambda: "cpu"

    # 5. Under torchrun, setup pins the process to an accelerator and picks its backend (NCCL
    #    on CUDA); without one it raises "No accelerator found". Gloo runs the same collectives
    #    (DDP gradient all-reduce, metric reductions, barriers) on CPU tensors.
    cli.maybe_setup_distributed = _setup_distributed_on_cpu

    setattr(trainer.Trainer, _APPLIED_MARK, True)
    return patched
