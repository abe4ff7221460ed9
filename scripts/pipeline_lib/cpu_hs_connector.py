"""A CPU-safe version of vLLM's ExampleHiddenStatesConnector.

The stock connector copies each finished request's hidden states out of the KV cache on a
CUDA stream into pinned host memory and writes the file from a thread pool. On a machine
without CUDA that crashes the engine at the first finished request (`pin_memory=True
requires a CUDA or other accelerator backend`). On CPU the cache already lives in host
memory, so this subclass replaces only that one method with a synchronous copy and write.

CpuFP8HiddenStatesConnector is the same for `hidden_states.storage: fp8`: the synchronous copy
from here, then hs-connectors' own FP8HiddenStatesConnector write step (its per-token fp8
quantization and file layout), through the method resolution order.

vLLM loads them by name in the engine's own processes:
    kv_transfer_config = {"kv_connector": "CpuHiddenStatesConnector",
                          "kv_connector_module_path": "pipeline_lib.cpu_hs_connector", ...}
so `scripts/` must be on PYTHONPATH for those processes (hidden_states.VllmBackend and the
online-training server set it).
"""
from __future__ import annotations

import fcntl
import os

import torch
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CopyDone:
    """Stands in for the CUDA event that get_finished() polls and the writer waits on: the
    copy is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Fancy indexing copies out of the cache, so the blocks may be freed right after.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).contiguous()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        # The class's own write step, here in this thread: it saves the file, then closes lock_fd,
        # which releases LOCK_EX so readers waiting on the lock proceed.
        done = _CopyDone()
        self._write_tensors(tensors, done, pending.filename, lock_fd)
        # get_finished() reports a request as sent only once its copy event is tracked.
        self._req_copy_events[pending.req_id] = done


class CpuFP8HiddenStatesConnector(CpuHiddenStatesConnector, FP8HiddenStatesConnector):
    """The synchronous CPU copy above, then hs-connectors' FP8 write (quantize, save, unlock)."""
