"""Hidden-state extraction for speculators' EAGLE-3 training data.

Three parts, used by extract_hidden_states.py (one shard) and gather_hidden_states.py:
- LayerSpec: which layers are captured and in what dtype (aux ids in order, then the final
  layer N = the last decoder layer's output before the final norm).
- HSStore: the file store `<store>/<key>/hs_{row}.safetensors`; names, validation, atomic
  commits, and cleanup of temp files an interrupted job left behind.
- Backends (BACKENDS registry): `vllm` (offline LLM with speculators' extract_hidden_states
  method and a hidden-states KV connector) and `transformers` (a forward pass with hooks on
  the needed layers only). Both write files with identical keys, shapes and dtypes, so they
  are interchangeable; tests/test_hidden_states.py checks they agree within bf16 tolerance.

torch, transformers and vllm are imported inside the functions that need them, so bad input
is reported before any heavy import.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from .digests import json_digest
from .errors import PipelineError
from .io import atomic_write_bytes
from .target import load_config, num_layers, resolve_aux_layer_ids, text_config

# Bump when the file layout changes: a new key, so old store entries are never reused.
STORE_FORMAT = 1
DTYPES = ("bfloat16", "float16", "float32")
SCRIPTS_DIR = Path(__file__).resolve().parents[1]


def hs_name(row: int) -> str:
    return f"hs_{row}.safetensors"


# --------------------------------------------------------------------------------------
# What is captured
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerSpec:
    aux_layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    dtype: str
    max_positions: int | None = None

    @property
    def final_layer_id(self) -> int:
        return self.num_layers

    @property
    def layer_ids(self) -> list[int]:
        """What vLLM's eagle_aux_hidden_state_layer_ids gets: aux ids, then the final layer."""
        return [*self.aux_layer_ids, self.final_layer_id]

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def layer_spec(target_dir: str | Path, settings: dict[str, Any]) -> LayerSpec:
    """The spec for a target and the stage settings; raises PipelineError naming the setting."""
    config = load_config(target_dir)
    text = text_config(config)
    n = num_layers(config)
    aux = resolve_aux_layer_ids(settings.get("aux_layer_ids"), n)
    dtype = settings.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        raise PipelineError(f"hidden_states.dtype = {dtype!r}: use one of {', '.join(DTYPES)}")
    if "hidden_size" not in text:
        raise PipelineError(f"{Path(target_dir) / 'config.json'}: no hidden_size; is this a decoder LLM?")
    return LayerSpec(tuple(aux), n, int(text["hidden_size"]), dtype, text.get("max_position_embeddings"))


def shard_range(num_rows: int, shard: int, num_shards: int) -> tuple[int, int]:
    """Contiguous rows owned by a shard; sizes differ by at most one (speculators' split)."""
    if not 0 <= shard < num_shards:
        raise PipelineError(f"--shard {shard} is out of range for --num-shards {num_shards} "
                            f"(valid: 0..{num_shards - 1})")
    size, extra = divmod(num_rows, num_shards)
    start = shard * size + min(shard, extra)
    return start, start + size + (1 if shard < extra else 0)


def store_key(target_digest: str, data_digest: str, spec: LayerSpec) -> str:
    """Short digest naming a store dir: files in it belong to exactly these inputs.

    The backend is not part of the key: both produce the same tensors (within bf16 noise),
    so switching backends reuses what is already extracted."""
    return json_digest({"format": STORE_FORMAT, "target": target_digest, "data": data_digest,
                        "layer_ids": spec.layer_ids, "dtype": spec.dtype})[len("sha256:"):][:16]


# --------------------------------------------------------------------------------------
# The file store
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    index: int
    input_ids: list[int]


@dataclass(frozen=True)
class FileRecord:
    row: int
    tokens: int
    bytes: int
    digest: str


def inspect_hs_bytes(data: bytes, input_ids: Sequence[int], spec: LayerSpec) -> str | None:
    """Why these file bytes are not a valid hs file for this row, or None when they are."""
    import torch
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for bad headers
        return f"unreadable safetensors ({type(err).__name__}: {err})"
    missing = {"token_ids", "hidden_states"} - tensors.keys()
    if missing:
        return f"missing tensors {sorted(missing)}"
    token_ids, hs = tensors["token_ids"], tensors["hidden_states"]
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        return f"token_ids is {token_ids.dtype} {list(token_ids.shape)}, expected int64 [T]"
    if token_ids.tolist() != list(input_ids):
        return "token_ids differ from the dataset's input_ids"
    expected = [len(input_ids), len(spec.layer_ids), spec.hidden_size]
    if list(hs.shape) != expected:
        return f"hidden_states shape {list(hs.shape)}, expected {expected}"
    if hs.dtype != spec.torch_dtype:
        return f"hidden_states dtype {hs.dtype}, expected {spec.dtype}"
    if not bool(torch.isfinite(hs).all()):
        return "hidden_states has non-finite values"
    return None


class HSStore:
    """`root/hs_{row}.safetensors`, complete files only. Writers use the temp names
    `.hs_{row}.safetensors.<tag>.tmp` (plus `.lock` from vLLM) and rename on success, so a
    killed job leaves temp names only; each shard removes those of its own rows."""

    def __init__(self, root: str | Path, spec: LayerSpec):
        self.root = Path(root)
        self.spec = spec
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, row: int) -> Path:
        return self.root / hs_name(row)

    def temp_path(self, row: int, tag: str) -> Path:
        return self.root / f".{hs_name(row)}.{tag}.tmp"

    def clean_temps(self, rows: range) -> list[str]:
        """Remove leftovers of interrupted writes for these rows (never other shards' rows)."""
        removed = []
        for entry in os.scandir(self.root):
            name = entry.name
            if not (name.startswith(".hs_") and ".safetensors." in name):
                continue
            index = name[len(".hs_"):name.index(".safetensors.")]
            if index.isdigit() and int(index) in rows:
                Path(entry.path).unlink(missing_ok=True)
                removed.append(name)
        return sorted(removed)

    def check(self, row: Row) -> FileRecord | str:
        """The record of a valid existing file, or why it must be (re)generated."""
        path = self.path(row.index)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "missing"
        reason = inspect_hs_bytes(data, row.input_ids, self.spec)
        if reason is not None:
            return reason
        return FileRecord(row.index, len(row.input_ids), len(data), _sha256(data))

    def write(self, row: Row, hidden_states) -> FileRecord:
        """Serialize and write atomically (transformers backend)."""
        import torch
        from safetensors.torch import save

        data = save({"hidden_states": hidden_states.contiguous(),
                     "token_ids": torch.tensor(row.input_ids, dtype=torch.int64)})
        self._require_valid(row, data, "transformers backend")
        atomic_write_bytes(self.path(row.index), data)
        return FileRecord(row.index, len(row.input_ids), len(data), _sha256(data))

    def commit(self, row: Row, temp: Path) -> FileRecord:
        """Validate a file a backend wrote under a temp name, then rename it into place."""
        data = temp.read_bytes()
        self._require_valid(row, data, f"vLLM output {temp.name}")
        with open(temp, "rb") as f:  # durable before it gets its final name
            os.fsync(f.fileno())
        os.replace(temp, self.path(row.index))
        return FileRecord(row.index, len(row.input_ids), len(data), _sha256(data))

    def _require_valid(self, row: Row, data: bytes, source: str) -> None:
        reason = inspect_hs_bytes(data, row.input_ids, self.spec)
        if reason is not None:
            # A backend bug, not bad input: stop before anything invalid gets a final name.
            raise RuntimeError(f"row {row.index}: {source} produced an invalid hidden-states file: {reason}")


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def batches(rows: Sequence[Row], size: int) -> Iterator[list[Row]]:
    for i in range(0, len(rows), size):
        yield list(rows[i:i + size])


def token_batches(rows: Sequence[Row], max_tokens: int) -> Iterator[list[Row]]:
    """Consecutive groups of rows with at most max_tokens tokens (at least one row each)."""
    group, tokens = [], 0
    for row in rows:
        if group and tokens + len(row.input_ids) > max_tokens:
            yield group
            group, tokens = [], 0
        group.append(row)
        tokens += len(row.input_ids)
    if group:
        yield group


# --------------------------------------------------------------------------------------
# Backends: Backend(target_dir, spec, settings, max_len); .extract(rows, store) yields one
# FileRecord per row as its file is committed, so an interrupted job keeps finished rows.
# --------------------------------------------------------------------------------------

class TransformersBackend:
    """A forward pass of the decoder (no lm_head) with hooks on exactly the needed layers:
    a pre-hook on decoder layer k captures the residual stream entering it (aux id k), a
    pre-hook on the final norm captures its input (id N) and stops the forward there."""

    name = "transformers"

    class _StopForward(Exception):
        pass

    def __init__(self, target_dir: str | Path, spec: LayerSpec, settings: dict[str, Any], max_len: int):
        import torch
        from transformers import AutoModelForCausalLM

        from .runtime import has_cuda

        self.spec = spec
        self.batch_size = int(settings.get("batch_size", 8))
        self.device = "cuda" if has_cuda() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=spec.torch_dtype, device_map=self.device,
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

    def extract(self, rows: Sequence[Row], store: HSStore) -> Iterator[FileRecord]:
        torch = self.torch
        # Similar lengths together: less padding. Padding goes on the right and needs no
        # attention mask: under causal attention a real token never sees the pads after it,
        # and the plain causal path is the fast one (a padding mask forces the slow SDPA path).
        ordered = sorted(rows, key=lambda r: len(r.input_ids))
        for batch in batches(ordered, self.batch_size):
            width = max(len(r.input_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for b, r in enumerate(batch):
                ids[b, :len(r.input_ids)] = torch.tensor(r.input_ids)
            self._captured.clear()
            with torch.inference_mode():
                try:
                    self.decoder(input_ids=ids.to(self.device), use_cache=False)
                except self._StopForward:
                    pass
            stacked = torch.stack([self._captured[s] for s in range(len(self.spec.layer_ids))], dim=2)
            stacked = stacked.to("cpu", self.spec.torch_dtype)
            for b, r in enumerate(batch):
                yield store.write(r, stacked[b, :len(r.input_ids)].clone())

    def close(self) -> None:
        self.decoder = None


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
        from .runtime import has_cuda

        if spec.max_positions and max_len + 1 > spec.max_positions:
            raise PipelineError(
                f"the longest tokenized row has {max_len} tokens; vLLM needs one position more but the "
                f"target allows {spec.max_positions}; lower tokenize.max_seq_len or use "
                f"hidden_states.backend: transformers")
        cuda = has_cuda()
        # The connector runs in the engine's own (spawned) processes; they must import it.
        path = os.environ.get("PYTHONPATH", "")
        if str(SCRIPTS_DIR) not in path.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS_DIR), path) if p)

        from vllm import LLM

        self.spec = spec
        self.tag = f"{os.getpid()}-vllm"
        self.llm = LLM(
            model=str(target_dir),
            dtype=spec.dtype,
            max_model_len=max_len + 1,
            enforce_eager=True,  # prefill only: graph capture would cost more than it saves
            enable_prefix_caching=False,  # every row's hidden states computed by its own request
            trust_remote_code=bool(settings.get("trust_remote_code", False)),
            tensor_parallel_size=max(1, _cuda_device_count()) if cuda else 1,
            disable_log_stats=True,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec.layer_ids}},
            },
            kv_transfer_config=connector_config(cuda),
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
                _wait_for_writer(temp)
                yield store.commit(r, temp)

    def close(self) -> None:
        """Stop the engine processes now rather than at interpreter exit."""
        engine = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        self.llm = None


def connector_config(cuda: bool) -> dict[str, Any]:
    """vLLM's kv_transfer_config: the stock connector on CUDA (async copy on a side stream),
    ours on CPU (the stock one needs pinned memory and CUDA streams). Every request names its
    own file (a temp name in the store), so the default storage path is never written; the
    "custom path" is safe here because only this process submits requests."""
    extra = {"shared_storage_path": tempfile.gettempdir(), "allow_custom_save_path": True}
    config = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": extra}
    if not cuda:
        config.update(kv_connector="CpuHiddenStatesConnector", kv_connector_module_path="pipeline_lib.cpu_hs_connector")
    return config


def _wait_for_writer(path: Path, timeout_s: float = 600.0) -> None:
    """The connector holds LOCK_EX on `<path>.lock` until the file is complete (on CUDA the
    write finishes in a thread after generate() returns); wait for it, then drop the lock."""
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
                    time.sleep(0.01)
        finally:
            os.close(fd)
        lock.unlink(missing_ok=True)
    if not path.exists():
        raise RuntimeError(f"{path}: vLLM reported this hidden-states file but it was never written")


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


BACKENDS = {"vllm": VllmBackend, "transformers": TransformersBackend}


def backend_class(name: str):
    if name not in BACKENDS:
        raise PipelineError(f"hidden_states.backend = {name!r}: use one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
