"""Process environment for the ML backends: offline hubs, vLLM on CPU, private temp dirs.
Called at the top of every script that loads a model, before torch/vllm are imported."""
from __future__ import annotations

import os


def has_cuda() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def setup(offline: bool = True) -> None:
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM CPU: KV cache size in GiB (default would take a large slice of a 24 GiB box).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's automatic OpenMP core binding pinned the CPU worker to one core whose time it then
    # shared with a second busy thread when run as a Snakemake job: the demo's trace shard made
    # ~0 rows in minutes instead of 256 in ~60 s. Unbound threads run at full speed.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
