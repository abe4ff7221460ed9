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


def vllm_engine_in_process(on_gpu_too: bool = False) -> bool:
    """Whether vLLM's offline engine (its EngineCore) runs in this process: the one decision
    for every job that starts an `LLM` (traces, hidden states, acceptance's engine children,
    the load check). Call it before `LLM(...)`; a child process inherits it.

    CPU: in this process. A separate EngineCore process imports torch and vLLM again and
    talks to us over sockets; on 2 cores it overlaps nothing. Measured on a shared 2-core x86-64
    CPU machine (2026-12-04, tiny test target, a fresh process per start): 29.6 s per engine start
    with the separate process, 11.1 s in-process; `LLM(...)` alone 16.6 s vs 2.2 s.
    GPU: vLLM's default, a separate EngineCore process, which schedules and processes outputs
    while the GPU computes (vLLM's architecture overview). Not a config setting: the right
    choice follows from the hardware, and vLLM's own switch VLLM_ENABLE_V1_MULTIPROCESSING,
    when set in the environment, still wins. Provenance records the variable.
    `on_gpu_too`: for a short job whose product is vLLM's own error message (the load check):
    in-process, the exception reaches the caller instead of "engine core failed, see above"."""
    if "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if not on_gpu_too and has_cuda() else "0"
    return int(os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]) == 0  # as vLLM reads it (envs.py)


def setup(offline: bool = True) -> None:
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM CPU: KV cache size in GiB (default would take a large slice of a 24 GiB machine).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's automatic OpenMP core binding pinned the CPU worker to one core whose time it then
    # shared with a second busy thread when run as a Snakemake job: the demo's trace shard made
    # ~0 rows in minutes instead of 256 in ~60 s. Unbound threads run at full speed.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    # A job that asked torch about CUDA before starting vLLM has initialised CUDA; vLLM 0.26 then
    # forks its engine core, which fails ("Cannot re-initialize CUDA in forked subprocess").
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


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
