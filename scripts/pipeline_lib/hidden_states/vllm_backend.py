"""vllm backend: speculators' extract_hidden_states method with a hidden-states KV connector."""
from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..errors import PipelineError
from .formats import storage_format
from .store import SCRIPTS_DIR, FileRecord, HSStore, LayerSpec, Row, register, token_batches


@register("vllm")
class VllmBackend:
    """speculators' way: vLLM runs each row as a prompt with max_tokens=1 under the
    `extract_hidden_states` speculative method; a KV connector writes each finished request's
    hidden states to the path given in its kv_transfer_params (a temp name in the store)."""

    name = "vllm"
    # Tokens handed to one generate() call. vLLM batches them itself (batch_size is not used);
    # files are committed after each call, so this bounds the work an interruption loses.
    # Small calls waste time: on CPU 8 rows per call ran ~3.5x slower than 64.
    TOKENS_PER_CALL = 65536

    def __init__(self, target_dir: str | Path, spec: LayerSpec, settings: dict[str, Any], max_len: int):
        from ..parallel import decide
        from ..runtime import vllm_engine_in_process

        if spec.max_positions and max_len + 1 > spec.max_positions:
            raise PipelineError(
                f"the longest tokenized row has {max_len} tokens; vLLM needs one position more but the "
                f"target allows {spec.max_positions}; lower tokenize.max_seq_len or use "
                f"hidden_states.backend: transformers")
        self.parallel = layout = decide().apply()
        cuda = layout.gpus > 0
        self.in_process = vllm_engine_in_process()
        # The connector runs where the engine's worker runs (a spawned process on GPU); it must import it.
        path = os.environ.get("PYTHONPATH", "")
        if str(SCRIPTS_DIR) not in path.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS_DIR), path) if p)

        from vllm import LLM

        self.spec = spec
        self.tag = f"{os.getpid()}-vllm"
        self.llm = LLM(
            model=str(target_dir),
            dtype=spec.run_dtype,
            max_model_len=max_len + 1,
            enforce_eager=True,  # prefill only: graph capture would cost more than it saves
            enable_prefix_caching=False,  # every row's hidden states computed by its own request
            trust_remote_code=bool(settings.get("trust_remote_code", False)),
            **layout.engine_kwargs(),
            disable_log_stats=True,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec.layer_ids}},
            },
            kv_transfer_config=connector_config(cuda, spec.storage),
        )

    def extract(self, rows: Sequence[Row], store: HSStore) -> Iterator[FileRecord]:
        from vllm import SamplingParams, TokensPrompt

        for batch in token_batches(rows, self.TOKENS_PER_CALL):
            temps = [store.temp_path(r.index, self.tag) for r in batch]
            prompts = [TokensPrompt(prompt_token_ids=r.input_ids) for r in batch]
            params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                     extra_args={"kv_transfer_params": {"hidden_states_path": str(t)}})
                      for t in temps]
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            for r, temp, out in zip(batch, temps, outputs):
                written = (out.kv_transfer_params or {}).get("hidden_states_path")
                if written != str(temp):
                    raise RuntimeError(f"row {r.index}: vLLM wrote hidden states to {written!r}, "
                                       f"expected {temp}; is allow_custom_save_path honoured?")
                _wait_for_writer(temp, step=self.llm.llm_engine.step if self.in_process else None)
                if self.spec.compute_dtype and self.spec.storage == "bf16":
                    _recast(temp, self.spec.torch_dtype)  # computed in float32, stored as bfloat16
                yield store.commit(r, temp)

    def close(self) -> None:
        """Stop the engine (its processes, where it has them) now rather than at interpreter exit."""
        engine = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        self.llm = None


def connector_config(cuda: bool, storage: str = "bf16", storage_path: str | None = None,
                     custom_paths: bool = True) -> dict[str, Any]:
    """vLLM's kv_transfer_config for a storage format (formats.py): the stock connectors on
    CUDA (async copy on a side stream; hs-connectors' FP8 one for fp8), ours on CPU (the stock
    ones need pinned memory and CUDA streams).

    Offline extraction names every request's file itself (a temp name in the store), so the
    default storage path is never written; the "custom path" is safe because only this process
    submits requests. A server for online training (custom_paths=False) writes each request to
    `storage_path/<request id>.safetensors`, where the trainer reads and deletes it."""
    name, module = (storage_format(storage).cuda_connector if cuda else storage_format(storage).cpu_connector)
    extra: dict[str, Any] = {"shared_storage_path": storage_path or tempfile.gettempdir()}
    if custom_paths:
        extra["allow_custom_save_path"] = True
    config: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    if module:
        config["kv_connector_module_path"] = module
    return config


def _wait_for_writer(path: Path, timeout_s: float = 600.0, step: Callable[[], Any] | None = None) -> None:
    """The connector holds LOCK_EX on `<path>.lock` until the file is complete (on CUDA the
    write finishes in a thread after generate() returns); wait for it, then drop the lock.
    `step`: the engine's step, for an engine in this process. The scheduler hands a finished
    request's save to the connector in the step after the one that finished it; a separate
    EngineCore process runs that step by itself, an in-process engine only when stepped."""
    lock = Path(f"{path}.lock")
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{path}: vLLM's writer held its lock for over {timeout_s:.0f} s")
                    if step is not None:
                        step()
                    time.sleep(0.01)
        finally:
            os.close(fd)
        lock.unlink(missing_ok=True)
    if not path.exists():
        raise RuntimeError(f"{path}: vLLM reported this hidden-states file but it was never written")


def _recast(path: Path, dtype) -> None:
    """Rewrite a connector's file (a temp name; commit() validates it next) with its hidden
    states in `dtype`, the store's. Read whole first: nothing stays mapped while it is rewritten."""
    from safetensors.torch import load, save

    tensors = load(path.read_bytes())
    tensors["hidden_states"] = tensors["hidden_states"].to(dtype)
    path.write_bytes(save(tensors))
