#!/usr/bin/env python
"""Run one job's command on GPUs of its own.

Run locally, Snakemake only COUNTS GPUs (`--resources gpu=N`); it never sets
CUDA_VISIBLE_DEVICES, so two concurrent GPU jobs would both land on device 0. Every rule
that may use a GPU runs its command through this wrapper, which decides what the job sees:

  --gpus 0             CUDA_VISIBLE_DEVICES="" when the machine has GPUs, so a CPU stage never
                       grabs one; on a machine without GPUs the environment is left alone.
  inside a SLURM job   (SLURM_JOB_ID set) SLURM already set CUDA_VISIBLE_DEVICES from the job's
                       gres; it is used as it is (and checked to hold enough devices).
  otherwise            N device ids are taken from the pool, each held through an flock'ed
                       lock file for the whole life of the command (a killed job frees its
                       devices at once); when too few are free it waits, up to --wait-timeout.

The pool is, first found: the ids the user pinned with CUDA_VISIBLE_DEVICES (the job gets
N of those); $PIPELINE_GPU_IDS (comma-separated ids, e.g. "0,1,2,3"; "" = no GPUs); the GPUs
`nvidia-smi -L` lists; torch.cuda.device_count().
Lock files: $PIPELINE_GPU_LOCK_DIR, default .snakemake/gpu-locks in the working directory
(one file per host and device; never delete them while jobs run). Waiting for free devices
gives up after $PIPELINE_GPU_WAIT_S seconds (default 3600) with a message naming the holders.

The wrapper logs one line to stderr saying which devices the job got, forwards signals to
the command and exits with the command's exit status.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.parallel import PIPELINE_PARALLEL_ENV  # noqa: E402
from pipeline_lib.processes import parent_death_hook  # noqa: E402

IDS_ENV = "PIPELINE_GPU_IDS"
LOCK_DIR_ENV = "PIPELINE_GPU_LOCK_DIR"
WAIT_ENV = "PIPELINE_GPU_WAIT_S"
DEFAULT_LOCK_DIR = ".snakemake/gpu-locks"
DEFAULT_WAIT_S = 3600.0
POLL_S = 0.25
# Passed on to the command (SIGINT only when a terminal did not already send it there too).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def log(message: str) -> None:
    print(f"run_on_gpus: {message}", file=sys.stderr, flush=True)


# --- the machine's GPUs ------------------------------------------------------------------


def parse_ids(text: str, where: str) -> list[str]:
    ids = [part.strip() for part in text.split(",") if part.strip()]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise PipelineError(f"{where}={text!r} lists device ids {dupes} more than once; list each GPU once")
    return ids


def ids_from_env(env: Mapping[str, str]) -> list[str] | None:
    raw = env.get(IDS_ENV)
    return None if raw is None else parse_ids(raw, IDS_ENV)


def parse_nvidia_smi_list(text: str) -> list[str]:
    """Indices of the `GPU <i>: <name> (UUID: ...)` lines of `nvidia-smi -L` (MIG lines skipped)."""
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", text, flags=re.MULTILINE)]


def ids_from_nvidia_smi(env: Mapping[str, str]) -> list[str] | None:
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi_list(out.stdout) if out.returncode == 0 else None


def ids_from_torch(env: Mapping[str, str]) -> list[str] | None:
    # Importing torch costs seconds: only worth it where a GPU driver is loaded.
    if not any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/kfd")):
        return None
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install counts as "no GPUs found here"
        return None


# Where the machine's GPU ids come from, asked in this order; the first answer wins.
GPU_SOURCES: dict[str, Callable[[Mapping[str, str]], list[str] | None]] = {
    IDS_ENV: ids_from_env,
    "nvidia-smi": ids_from_nvidia_smi,
    "torch": ids_from_torch,
}


@dataclass
class Pool:
    ids: list[str]
    source: str


def machine_gpus(env: Mapping[str, str]) -> Pool:
    for source, find in GPU_SOURCES.items():
        ids = find(env)
        if ids is not None:
            return Pool(ids, source)
    return Pool([], f"{IDS_ENV} unset, no nvidia-smi, no GPU driver for torch")


# --- what the job gets -------------------------------------------------------------------


@dataclass
class Plan:
    """visible: the job's CUDA_VISIBLE_DEVICES (None = leave the environment alone).
    pool: when set, `visible` is decided by taking locks on N ids of it."""

    why: str
    visible: str | None = None
    pool: Pool | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def plan(gpus: int, env: Mapping[str, str]) -> Plan:
    pinned = env.get("CUDA_VISIBLE_DEVICES")
    if gpus == 0:
        found = machine_gpus(env)
        if found.ids:
            return Plan(f"CPU job: GPUs hidden ({len(found.ids)} on this machine, from {found.source})", visible="")
        return Plan("CPU job on a machine without GPUs: environment unchanged")

    if env.get("SLURM_JOB_ID"):
        return _slurm_plan(gpus, env, pinned)

    if pinned is not None:
        ids = parse_ids(pinned, "CUDA_VISIBLE_DEVICES")
        _need(gpus, ids, "CUDA_VISIBLE_DEVICES (pinned by you)",
              "unset CUDA_VISIBLE_DEVICES or pin more devices")
        return Plan("", pool=Pool(ids, "CUDA_VISIBLE_DEVICES, pinned"))

    found = machine_gpus(env)
    _need(gpus, found.ids, found.source,
          f"set this stage's resources gpu to 0 to run it on CPU, or list the GPUs in {IDS_ENV}")
    # nvidia-smi numbers GPUs in PCI bus order; make CUDA number them the same way.
    extra = {}
    if found.source == "nvidia-smi" and "CUDA_DEVICE_ORDER" not in env:
        extra["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return Plan("", pool=found, extra_env=extra)


def _need(gpus: int, ids: list[str], source: str, fix: str) -> None:
    if len(ids) < gpus:
        have = f"only {len(ids)} ({', '.join(ids)})" if ids else "none"
        raise PipelineError(f"the job needs {gpus} GPU(s) but the GPU pool has {have} (from: {source}); {fix}")


def _slurm_plan(gpus: int, env: Mapping[str, str], visible: str | None) -> Plan:
    job = env["SLURM_JOB_ID"]
    if visible is None:
        # SLURM sets it for every gres/gpu allocation; without it the job would see all GPUs.
        log(f"warning: SLURM job {job} asked for {gpus} GPU(s) but SLURM set no CUDA_VISIBLE_DEVICES; "
            f"the job sees every GPU of the node (check the cluster's gres.conf and the job's gpu resource)")
        return Plan(f"SLURM job {job}: CUDA_VISIBLE_DEVICES not set, environment unchanged")
    ids = parse_ids(visible, "CUDA_VISIBLE_DEVICES")
    # A multi-node job's --gpus counts all nodes together, so only a one-node job can be checked.
    if env.get("SLURM_NNODES", "1") == "1" and len(ids) < gpus:
        raise PipelineError(
            f"SLURM job {job} set CUDA_VISIBLE_DEVICES={visible!r} ({len(ids)} device(s)) but the job needs "
            f"{gpus}; check the profile's gpu/gres resources for this rule (profiles/slurm/config.yaml)")
    return Plan(f"SLURM job {job} gave CUDA_VISIBLE_DEVICES={visible} ({gpus} GPU(s) asked)", visible=visible)


# --- device locks --------------------------------------------------------------------------


class DeviceLocks:
    """One lock file per (host, device id); a device belongs to whoever holds its flock.

    flock locks die with the process that holds them, so a killed job frees its devices with
    no cleanup. Lock files are never deleted: deleting one that another job waits on would let
    two jobs lock different files for the same device."""

    def __init__(self, lock_dir: Path, host: str | None = None):
        self.dir = lock_dir
        self.host = host or socket.gethostname().split(".")[0]
        self.held: dict[str, int] = {}

    def path(self, device: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", device)
        return self.dir / f"{self.host}.gpu-{safe}.lock"

    def try_acquire(self, pool: list[str], n: int, holder: str) -> list[str] | None:
        """Lock n free devices of `pool` at once, or none (a partial set is given back, so two
        jobs that each hold half of what the other needs can't block each other forever)."""
        for device in pool:
            if len(self.held) == n:
                break
            fd = self._open(self.path(device))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:  # who holds it, for the messages of jobs that wait
                os.ftruncate(fd, 0)
                os.pwrite(fd, holder.encode(), 0)
            except OSError:
                pass
            self.held[device] = fd
        if len(self.held) == n:
            return list(self.held)
        self.release()
        return None

    @staticmethod
    def _open(path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's lock file: flock works on a read-only fd too
            return os.open(path, os.O_RDONLY)
        try:
            os.fchmod(fd, 0o666)  # so other users' jobs on this machine can lock it too
        except OSError:
            pass
        return fd

    def acquire(self, pool: list[str], n: int, holder: str, timeout: float) -> tuple[list[str], float]:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PipelineError(f"cannot create the GPU lock dir {self.dir} ({err.strerror}); "
                                f"point {LOCK_DIR_ENV} at a writable directory") from None
        start = time.monotonic()
        said_waiting = False
        while True:
            got = self.try_acquire(pool, n, holder)
            if got is not None:
                return got, time.monotonic() - start
            waited = time.monotonic() - start
            if waited >= timeout:
                raise PipelineError(
                    f"gave up after {waited:.0f} s waiting for {n} free GPU(s) of [{', '.join(pool)}]; "
                    f"held by: {self.describe_holders(pool)}. Wait for those jobs, or raise the wait "
                    f"limit ({WAIT_ENV} or --wait-timeout); lock files are in {self.dir}")
            if not said_waiting:
                log(f"waiting for {n} free GPU(s) of [{', '.join(pool)}]; held by: {self.describe_holders(pool)}")
                said_waiting = True
            time.sleep(POLL_S)

    def describe_holders(self, pool: list[str]) -> str:
        parts = []
        for device in pool:
            try:
                text = self.path(device).read_text().strip()
            except OSError:
                text = ""
            parts.append(f"{device}: {text or '?'}")
        return "; ".join(parts)

    def release(self) -> None:
        for fd in self.held.values():
            os.close(fd)  # closing the only descriptor drops the flock
        self.held.clear()


def holder_text(command: list[str]) -> str:
    what = " ".join(os.path.basename(part) for part in command[:2])
    return f"pid {os.getpid()} ({what}) since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"


# --- running the command -----------------------------------------------------------------


def exec_command(command: list[str], env: dict[str, str]) -> None:
    """Nothing to hold: become the command (signals and exit status are then its own)."""
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        raise PipelineError(f"cannot run {command[0]!r}: {err.strerror}") from None


def _tty_also_signals_child() -> bool:
    """True when a terminal's Ctrl-C already reaches the command (it shares our foreground
    process group), so forwarding SIGINT would deliver it twice."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _die_with_parent_hook() -> Callable[[], None] | None:
    """preexec_fn for the command: if the wrapper dies (even by SIGKILL), its locks are gone,
    so the command must not keep using the devices; the kernel then kills it (Linux only)."""
    return parent_death_hook(signal.SIGKILL)


def run_holding_locks(command: list[str], env: dict[str, str]) -> int:
    """Run the command as a child (the locks stay with this process), forward signals to it,
    return its exit status (negative: killed by that signal)."""
    child: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum, _frame):
        if signum == signal.SIGINT and _tty_also_signals_child():
            return
        if child is None:
            pending.append(signum)
        elif child.poll() is None:
            child.send_signal(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent_hook())
    except OSError as err:
        raise PipelineError(f"cannot run {command[0]!r}: {err.strerror}") from None
    for signum in pending:
        child.send_signal(signum)
    return child.wait()


def exit_like(returncode: int) -> int:
    """Exit as the command did: with its code, or killed by the same signal."""
    if returncode < 0:
        sys.stderr.flush()
        try:
            signal.signal(-returncode, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), -returncode)
        return 128 - returncode  # only if that signal does not terminate
    return returncode


# --- command line ------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="run_on_gpus.py",
        usage="run_on_gpus.py --gpus N [--pipeline-parallel P] [--wait-timeout S] [--lock-dir DIR] -- COMMAND [ARGS...]",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, required=True, help="GPUs the command needs (0 = CPU job)")
    p.add_argument("--pipeline-parallel", type=int, default=1,
                   help="vLLM pipeline parallel size of the job's engine (resources.<stage>.pipeline_parallel); "
                        f"passed on as ${PIPELINE_PARALLEL_ENV}, read by pipeline_lib/parallel.py")
    p.add_argument("--wait-timeout", type=float, default=None,
                   help=f"seconds to wait for free GPUs before failing (default ${WAIT_ENV} or {DEFAULT_WAIT_S:.0f})")
    p.add_argument("--lock-dir", type=Path, default=None,
                   help=f"lock file directory (default ${LOCK_DIR_ENV} or {DEFAULT_LOCK_DIR})")
    if "--" in argv:
        cut = argv.index("--")
        options, command = argv[:cut], argv[cut + 1:]
    else:
        options, command = argv, []
    args = p.parse_args(options)
    if not command:
        p.error("no command given: put it after `--`, e.g. run_on_gpus.py --gpus 1 -- python train.py")
    if args.gpus < 0:
        p.error(f"--gpus must be 0 or more, got {args.gpus}")
    if args.pipeline_parallel < 1 or (args.gpus and args.gpus % args.pipeline_parallel):
        p.error(f"--pipeline-parallel {args.pipeline_parallel} must be 1 or more and divide --gpus {args.gpus}")
    return args, command


def wait_limit(args: argparse.Namespace, env: Mapping[str, str]) -> float:
    if args.wait_timeout is not None:
        return args.wait_timeout
    raw = env.get(WAIT_ENV)
    if raw is None:
        return DEFAULT_WAIT_S
    try:
        return float(raw)
    except ValueError:
        raise PipelineError(f"{WAIT_ENV}={raw!r} is not a number of seconds") from None


def main() -> int:
    args, command = parse_args(sys.argv[1:])
    env = dict(os.environ)
    env[PIPELINE_PARALLEL_ENV] = str(args.pipeline_parallel)
    job_plan = plan(args.gpus, env)
    env.update(job_plan.extra_env)

    if job_plan.pool is None:
        if job_plan.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = job_plan.visible
        log(job_plan.why)
        exec_command(command, env)

    lock_dir = args.lock_dir or Path(env.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
    locks = DeviceLocks(lock_dir)
    pool = job_plan.pool
    got, waited = locks.acquire(pool.ids, args.gpus, holder_text(command), wait_limit(args, env))
    env["CUDA_VISIBLE_DEVICES"] = ",".join(got)
    log(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ({args.gpus} of {len(pool.ids)} GPU(s) "
        f"from {pool.source}; waited {waited:.1f} s; locks in {lock_dir})")
    return exit_like(run_holding_locks(command, env))


if __name__ == "__main__":
    run_main(main)
