"""A stage's job resources, decided in one place for the rules, the plan and the dtype and
draft-type checks: the stage's own `resources.<stage>` keys over `resources.default`'s.

Threads follow the GPUs where `cpus_per_gpu` is set (the stage's, else the default's): a job of
N GPUs gets N x cpus_per_gpu threads (SLURM: --cpus-per-task), unless the stage's own section
names its threads. An 8-GPU vLLM job needs CPUs for its 8 workers, not the default's 2."""
from __future__ import annotations

from typing import Any


def stage_resources(config: dict[str, Any], stage: str) -> dict[str, Any]:
    resources = config.get("resources") or {}
    own = resources.get(stage) or {}
    res = {**(resources.get("default") or {}), **own}
    per_gpu = res.pop("cpus_per_gpu", None)
    if per_gpu and int(res.get("gpu") or 0) > 0 and "threads" not in own:
        res["threads"] = per_gpu * int(res["gpu"])
    return res


def stage_gpus(config: dict[str, Any], stage: str) -> int:
    return int(stage_resources(config, stage).get("gpu") or 0)
