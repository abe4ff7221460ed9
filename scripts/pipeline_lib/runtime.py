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


def padded_batch_attention() -> None:
    """Attention kernels for batched, left-padded decoding on CUDA: cuDNN's SDPA off, so torch
    picks the memory-efficient kernel, which takes the padding mask as it is. Measured on an
    H200 with the demo target's shape (bench/decode_designs.py, batch 256, 2026-12-04): with
    cuDNN, attention plus its mask preparation was 75% of each decoding step's GPU time, and an
    uncompiled generate spent 64 ms per step on shapes it had not seen (cuDNN builds a plan per
    shape, and a growing cache makes a new shape every step) against 23 ms with cuDNN off."""
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)
