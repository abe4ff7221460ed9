"""How the training processes are started: one process (CPU or one GPU), torchrun with one
process per GPU (speculators then shards with FSDP/DDP itself) or with `cpu_processes` gloo
processes on a machine without GPUs, or srun starting one torchrun per node that meet through
a c10d rendezvous on the allocation's first node.

plan() only builds the command and the environment it needs; run() executes it. Commands are
plain argv lists (no shell), so paths with spaces survive and tests can compare them."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .errors import PipelineError

DEFAULT_RDZV_PORT = 29500
TERMINATE_GRACE_S = 150  # > speculators' 120 s interrupt-save watchdog


@dataclass(frozen=True)
class LaunchPlan:
    mode: str                     # a key of LAUNCHERS
    command: list[str]            # empty: run in this process
    env: dict[str, str] = field(default_factory=dict)  # added to the current environment
    world_size: int = 1

    @property
    def in_process(self) -> bool:
        return not self.command


@dataclass(frozen=True)
class LaunchRequest:
    gpus: int
    nodes: int
    worker: list[str]             # script + args each training process runs (no interpreter)
    cpu_processes: int = 1        # with gpus == 0: processes on this machine's CPU (gloo)
    python: str = sys.executable
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    head_node: Callable[[str], str] | None = None  # SLURM nodelist -> first host (tests inject)


def _in_process(req: LaunchRequest) -> LaunchPlan:
    return LaunchPlan("in_process", [], {}, world_size=1)


def _torchrun(req: LaunchRequest) -> LaunchPlan:
    # `python -m torch.distributed.run` is torchrun with this very interpreter (a `torchrun`
    # on PATH may belong to another environment). --standalone picks a free local port.
    procs = req.gpus or req.cpu_processes
    cmd = [req.python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={procs}", "--max-restarts=0", *req.worker]
    return LaunchPlan("torchrun", cmd, {"PYTHONUNBUFFERED": "1"}, world_size=procs)


def _srun_torchrun(req: LaunchRequest) -> LaunchPlan:
    env = req.environ
    job_id, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        raise PipelineError(
            f"--nodes {req.nodes}: multi-node training runs inside a SLURM allocation "
            f"(SLURM_JOB_ID/SLURM_JOB_NODELIST are not set); run the pipeline with the slurm "
            f"profile and resources.train.nodes = {req.nodes}, or set nodes: 1")
    allocated = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if allocated and int(allocated) < req.nodes:
        raise PipelineError(f"--nodes {req.nodes} but the SLURM allocation has {allocated} node(s); "
                            f"set resources.train.nodes to at most {allocated}")
    if req.gpus % req.nodes:
        raise PipelineError(
            f"--gpus {req.gpus} over --nodes {req.nodes}: resources.train.gpu is the job's total "
            f"GPU count and must split evenly over its nodes (e.g. gpu: {req.nodes * max(1, req.gpus // req.nodes)})")
    per_node = req.gpus // req.nodes
    head = (req.head_node or first_host)(nodelist)
    # A port derived from the job id: two jobs sharing a head node don't collide.
    port = int(env.get("MASTER_PORT") or DEFAULT_RDZV_PORT + int(job_id) % 1000)
    cmd = ["srun", f"--nodes={req.nodes}", f"--ntasks={req.nodes}", "--ntasks-per-node=1",
           "--kill-on-bad-exit=1",
           req.python, "-m", "torch.distributed.run", f"--nnodes={req.nodes}",
           f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={job_id}", "--max-restarts=0",
           *req.worker]
    extra = {"PYTHONUNBUFFERED": "1"}
    # Since Slurm 22.05 srun no longer inherits the batch job's --cpus-per-task.
    if env.get("SLURM_CPUS_PER_TASK"):
        extra["SRUN_CPUS_PER_TASK"] = env["SLURM_CPUS_PER_TASK"]
    return LaunchPlan("srun_torchrun", cmd, extra, world_size=req.gpus)


# One place to add or swap a launcher (e.g. mpirun, a cloud job API).
LAUNCHERS: dict[str, Callable[[LaunchRequest], LaunchPlan]] = {
    "in_process": _in_process,
    "torchrun": _torchrun,
    "srun_torchrun": _srun_torchrun,
}


def select_mode(gpus: int, nodes: int, cpu_processes: int = 1) -> str:
    if gpus < 0 or nodes < 1 or cpu_processes < 1:
        raise PipelineError(f"--gpus {gpus} --nodes {nodes} --cpu-processes {cpu_processes}: need gpus >= 0, "
                            f"nodes >= 1 and cpu_processes >= 1 (resources.train.gpu / resources.train.nodes)")
    if gpus == 0 and cpu_processes > 1:
        if nodes > 1:
            raise PipelineError(f"--cpu-processes {cpu_processes} trains on this machine's CPU; it does not "
                                f"combine with --nodes {nodes}")
        return "torchrun"
    if nodes > 1:
        if gpus < nodes:
            raise PipelineError(f"--nodes {nodes} needs at least one GPU per node, got --gpus {gpus} "
                                f"(resources.train.gpu is the job's total GPU count)")
        return "srun_torchrun"
    return "torchrun" if gpus > 1 else "in_process"


def plan(req: LaunchRequest) -> LaunchPlan:
    return LAUNCHERS[select_mode(req.gpus, req.nodes, req.cpu_processes)](req)


def first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist expression (`gpu[01-04]` -> `gpu01`), via scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        said = (getattr(err, "stderr", None) or "").strip()[-500:]
        raise PipelineError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol: {err}"
                            + (f"\n{said}" if said else "")) from None
    if not out:
        raise PipelineError(f"scontrol show hostnames {nodelist!r} returned no host")
    return out[0]


def run(launch: LaunchPlan) -> int:
    """Run a planned command, streaming its output into this job's log; returns its exit code."""
    print("launching: " + " ".join(launch.command), flush=True)
    proc = subprocess.Popen(launch.command, env={**os.environ, **launch.env})
    try:
        return proc.wait()
    except BaseException:
        # This job is stopping (a signal, or online training's server died): SIGTERM lets
        # torchrun stop its workers (speculators saves a checkpoint on it), SIGKILL if it hangs.
        proc.terminate()
        try:
            proc.wait(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
