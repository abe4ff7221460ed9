"""transformers backend: a hooked decoder forward (no vLLM needed), pipelined with the writes.

The GPU runs forward passes back to back while a bounded pool of writer threads turns earlier
batches into files: the forward of batch i+1 overlaps the device-to-host copy of batch i (pinned
host buffers, non-blocking copies) and the serialization, validation, hashing and fsync'd atomic
commit of batches i, i-1, ... on the CPU. The store's guarantees are the writers' steps, in order:
each file is written under a temp name, read back and validated, fsync'd, and only then renamed;
an interrupted job leaves temp names only, which the next run removes."""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..errors import PipelineError
from .store import FileRecord, HSStore, LayerSpec, Row, hs_tensors, register

# Host buffers in flight: the forward may run this many batches ahead of the slowest writer,
# which bounds pinned host memory at HOST_BUFFERS x batch_tokens x layers x hidden x 2 bytes.
HOST_BUFFERS = 3
# Concurrent fsync'd writers: more did not help on an H200 node's local disk (4 threads wrote 1.6 GB/s,
# 8 threads 1.5 GB/s) and each one holds a batch's rows in memory.
MAX_WRITERS = 8


def writer_count() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, min(MAX_WRITERS, cpus - 1))


def plan_batches(rows: Sequence[Row], max_rows: int, max_tokens: int) -> list[list[Row]]:
    """Rows sorted by length, grouped so that a batch's padded size (rows x its longest row)
    stays within max_tokens and max_rows (a row longer than max_tokens goes alone). Similar
    lengths together waste little padding."""
    batches, batch = [], []
    for row in sorted(rows, key=lambda r: len(r.input_ids)):
        width = len(row.input_ids)  # sorted: the newest row is the longest
        if batch and ((len(batch) + 1) * width > max_tokens or len(batch) == max_rows):
            batches.append(batch)
            batch = []
        batch.append(row)
    if batch:
        batches.append(batch)
    return batches


@register("transformers")
class TransformersBackend:
    """A forward pass of the decoder (no lm_head) with hooks on exactly the needed layers:
    a pre-hook on decoder layer k captures the residual stream entering it (aux id k), a
    pre-hook on the final norm captures its input (id N) and stops the forward there."""

    class _StopForward(Exception):
        pass

    def __init__(self, target_dir: str | Path, spec: LayerSpec, settings: dict[str, Any], max_len: int):
        import torch
        from transformers import AutoModelForCausalLM

        from ..runtime import has_cuda

        self.spec = spec
        self.batch_size = int(settings.get("batch_size", 8))
        self.batch_tokens = int(settings.get("batch_tokens", 16384))
        self.writers = writer_count()
        self.device = "cuda" if has_cuda() else "cpu"
        if self.device == "cuda":
            # The CPU only serves the writers here; one intra-op thread per writer keeps their
            # torch calls (validation) from each starting a full OpenMP team.
            torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(  # computes in run_dtype; capture() casts to the files' dtype
            str(target_dir), dtype=getattr(torch, spec.run_dtype), device_map=self.device,
            trust_remote_code=bool(settings.get("trust_remote_code", False)))
        self.decoder = model.get_decoder().eval()
        del model  # only the decoder is kept (the lm_head and its logits are never needed)
        layers = getattr(self.decoder, "layers", None)
        norm = getattr(self.decoder, "norm", None)
        if layers is None or norm is None or len(layers) != spec.num_layers:
            raise PipelineError(
                f"{target_dir}: the transformers backend needs a decoder with `.layers` "
                f"({spec.num_layers} of them) and a final `.norm`; this architecture has neither "
                f"layout; set hidden_states.backend: vllm")
        self._captured: dict[int, Any] = {}
        for slot, layer_id in enumerate(spec.aux_layer_ids):
            layers[layer_id].register_forward_pre_hook(self._capture_hook(slot), with_kwargs=True)
        norm.register_forward_pre_hook(self._capture_hook(len(spec.aux_layer_ids), stop=True), with_kwargs=True)
        self.torch = torch

    def _capture_hook(self, slot: int, stop: bool = False):
        def hook(module, args, kwargs):
            self._captured[slot] = args[0] if args else kwargs["hidden_states"]
            if stop:
                raise self._StopForward()
        return hook

    def plan(self, rows: Sequence[Row]) -> list[list[Row]]:
        return plan_batches(rows, self.batch_size, self.batch_tokens)

    def forward(self, batch: Sequence[Row]) -> list:
        """The hooked forward of one batch: the captured layers' tensors [rows, longest row,
        hidden] on the device, in layer_ids order, queued (not synchronized).

        Padding goes on the right and needs no attention mask: under causal attention a real
        token never sees the pads after it, and the plain causal path is the fast one (a
        padding mask forces the slow SDPA path)."""
        torch = self.torch
        width = max(len(r.input_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for b, r in enumerate(batch):
            ids[b, :len(r.input_ids)] = torch.tensor(r.input_ids)
        self._captured.clear()
        try:
            with torch.inference_mode():
                try:
                    self.decoder(input_ids=ids.to(self.device, non_blocking=True), use_cache=False)
                except self._StopForward:
                    pass
            return [self._captured[s] for s in range(len(self.spec.layer_ids))]
        except torch.OutOfMemoryError:
            raise PipelineError(f"out of memory in a forward pass of {len(batch)} rows x {width} tokens; "
                                f"lower hidden_states.batch_tokens ({self.batch_tokens}) or "
                                f"hidden_states.batch_size ({self.batch_size})") from None
        finally:
            self._captured.clear()

    def capture(self, batch: Sequence[Row]):
        """[rows, longest row, layers, hidden] on the device in the store's dtype, queued."""
        with self.torch.inference_mode():
            return self.torch.stack(self.forward(batch), dim=2).to(self.spec.torch_dtype)

    def extract(self, rows: Sequence[Row], store: HSStore) -> Iterator[FileRecord]:
        spec = self.spec
        budget_bytes = self.batch_tokens * len(spec.layer_ids) * spec.hidden_size * spec.torch_dtype.itemsize
        with _WritePipeline(store, self.device, self.writers, f"{os.getpid()}-hf", budget_bytes) as pipeline:
            for batch in self.plan(rows):
                pipeline.submit(batch, self.capture(batch))
                yield from pipeline.finished()
            yield from pipeline.drain()

    def close(self) -> None:
        self.decoder = None


class _HostBuffers:
    """HOST_BUFFERS reusable host tensors (pinned when copying from a GPU, so the copy is
    asynchronous). acquire() blocks while all are in use: that is the pipeline's backpressure."""

    def __init__(self, torch, pinned: bool, min_bytes: int):
        self.torch, self.pinned, self.min_bytes = torch, pinned, min_bytes
        self.free: queue.Queue = queue.Queue()
        for _ in range(HOST_BUFFERS):
            self.free.put(torch.empty(0, dtype=torch.uint8))

    def acquire(self, like):
        """A host tensor shaped and typed like `like` (a device tensor)."""
        torch = self.torch
        raw = self.free.get()
        nbytes = like.numel() * like.element_size()
        if raw.numel() < nbytes:  # sized for a full batch once (pinning is slow), then reused
            raw = torch.empty(max(nbytes, self.min_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        return raw, raw[:nbytes].view(like.dtype).view(like.shape)

    def release(self, raw) -> None:
        self.free.put(raw)


class _WritePipeline:
    """Copies each captured batch into a host buffer and hands its rows to a pool of writer
    threads; finished() and drain() yield the FileRecords of committed files (in completion
    order). A writer's error is raised in the caller; on any exit the pool is shut down, so no
    write outlives the job (a cancelled or interrupted row keeps only its temp name)."""

    def __init__(self, store: HSStore, device: str, writers: int, tag: str, buffer_bytes: int):
        import torch

        self.torch, self.store, self.tag = torch, store, tag
        self.cuda = device == "cuda"
        self.buffers = _HostBuffers(torch, pinned=self.cuda, min_bytes=buffer_bytes)
        self.pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="hs-writer")
        self.pending: set[Future] = set()

    def __enter__(self) -> "_WritePipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, batch: Sequence[Row], captured) -> None:
        raw, host = self.buffers.acquire(captured)
        host.copy_(captured, non_blocking=self.cuda)
        ready = None
        if self.cuda:
            ready = self.torch.cuda.Event()
            ready.record()
        remaining = _Countdown(len(batch), lambda: self.buffers.release(raw))
        for b, row in enumerate(batch):
            self.pending.add(self.pool.submit(self._write, row, host, b, ready, remaining))

    def _write(self, row: Row, host, b: int, ready, remaining: "_Countdown") -> FileRecord:
        from safetensors.torch import save_file

        try:
            if ready is not None:
                ready.synchronize()  # the batch's device-to-host copy has landed
            temp = self.store.temp_path(row.index, self.tag)
            # bf16: the buffer's slice as is; fp8: quantized here, in the writer thread.
            tensors = hs_tensors(row, host[b, :len(row.input_ids)], self.store.spec)
            save_file(tensors, str(temp))  # serialized straight from the buffer, without the GIL
            return self.store.commit(row, temp, source="transformers backend")
        finally:
            remaining.done()

    def finished(self) -> Iterator[FileRecord]:
        done = {f for f in self.pending if f.done()}
        yield from self._collect(done)

    def drain(self) -> Iterator[FileRecord]:
        while self.pending:
            done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
            yield from self._collect(done)

    def _collect(self, done: set[Future]) -> Iterator[FileRecord]:
        self.pending -= done
        for future in done:
            yield future.result()  # re-raises a writer's error here


class _Countdown:
    """Runs `then` once `count` rows of a batch are written (or failed): frees its buffer."""

    def __init__(self, count: int, then):
        self.count, self.then, self.lock = count, then, threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self.then()
