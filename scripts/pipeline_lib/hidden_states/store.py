"""What is captured and where it lives: the layer spec, shard ranges, store keys, and the file
store (names, validation, atomic commits, cleanup of temp files an interrupted job left), plus
the backend registry. Backends live in their own modules in this package."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..digests import json_digest
from ..dtypes import hidden_file_dtype
from ..errors import PipelineError
from ..io import atomic_write_bytes
from ..target import load_config, num_layers, resolve_aux_layer_ids, text_config
from .formats import inspect_tensors, storage_format

# Bump when the file layout changes: a new key, so old store entries are never reused.
STORE_FORMAT = 1
DTYPES = ("bfloat16", "float16", "float32")
SCRIPTS_DIR = Path(__file__).resolve().parents[2]


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
    storage: str = "bf16"  # on-disk format (formats.py): bf16 = as extracted, fp8 = hs-connectors' FP8
    # What the target runs in when not `dtype` (the files' dtype): float32 on a CPU without bf16
    # instructions (hidden_states.dtype auto), written as bfloat16 files (dtypes.hidden_file_dtype).
    compute_dtype: str | None = None

    @property
    def run_dtype(self) -> str:
        """The dtype the target computes in (vLLM's --dtype, transformers' from_pretrained)."""
        return self.compute_dtype or self.dtype

    @property
    def format(self):
        return storage_format(self.storage)

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

    def file_bytes(self, tokens: int) -> int:
        """Size of one row's file in its storage format: hidden states (fp8: plus a scale per
        token), int64 token ids, safetensors header (<256 B)."""
        return tokens * (self.format.bytes_per_token(len(self.layer_ids), self.hidden_size, self.dtype) + 8) + 256


def layer_spec(target_dir: str | Path, settings: dict[str, Any], files_as_computed: bool = False) -> LayerSpec:
    """The spec for a target and the stage settings; raises PipelineError naming the setting.
    hidden_states.dtype is what the target computes in; the files are in that dtype, except that
    float32 is stored as bfloat16 (dtypes.hidden_file_dtype) unless `files_as_computed` (an online
    server's files, read once and deleted)."""
    config = load_config(target_dir)
    text = text_config(config)
    n = num_layers(config)
    aux = resolve_aux_layer_ids(settings.get("aux_layer_ids"), n)
    dtype = settings.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        raise PipelineError(f"hidden_states.dtype = {dtype!r}: use one of {', '.join(DTYPES)}")
    if "hidden_size" not in text:
        raise PipelineError(f"{Path(target_dir) / 'config.json'}: no hidden_size; is this a decoder LLM?")
    storage = storage_format(settings.get("storage", "bf16")).name  # an unknown name fails here, naming the key
    stored = dtype if files_as_computed else hidden_file_dtype(dtype)
    return LayerSpec(tuple(aux), n, int(text["hidden_size"]), stored, text.get("max_position_embeddings"), storage,
                     compute_dtype=dtype if dtype != stored else None)


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
    so switching backends reuses what is already extracted. The storage format is part of it
    only when it is not the original bf16 layout, so existing bf16 stores keep their keys."""
    key = {"format": STORE_FORMAT, "target": target_digest, "data": data_digest,
           "layer_ids": spec.layer_ids, "dtype": spec.dtype}
    if spec.storage != "bf16":
        key["storage"] = spec.storage
    if spec.compute_dtype:  # files computed in another dtype than stored never share a store with the others
        key["compute_dtype"] = spec.compute_dtype
    return json_digest(key)[len("sha256:"):][:16]


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
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for bad headers
        return f"unreadable safetensors ({type(err).__name__}: {err})"
    return inspect_tensors(tensors, input_ids, len(spec.layer_ids), spec.hidden_size, spec.dtype, spec.storage)


def hs_tensors(row: Row, hidden_states, spec: LayerSpec) -> dict[str, Any]:
    """The tensors of one row's file in the spec's storage format (fp8: hs-connectors'
    quantization), for safetensors' save/save_file."""
    import torch

    return spec.format.to_tensors(hidden_states, torch.tensor(row.input_ids, dtype=torch.int64))


def serialize_hs(row: Row, hidden_states, spec: LayerSpec) -> bytes:
    """The file bytes of one row in the spec's storage format."""
    from safetensors.torch import save

    return save(hs_tensors(row, hidden_states, spec))


class HSStore:
    """`root/hs_{row}.safetensors`, complete files only. A backend writes each row into a
    directory of its own, `.hs_{row}.safetensors.<tag>.tmp/`, and the file is renamed into
    place on success: what the writer leaves beside its file stays in there (safetensors
    writes through a `.tmpXXXXXX` file that it renames, vLLM's connector a `.lock`), so a
    killed job leaves temp names only; each shard removes those of its own rows."""

    def __init__(self, root: str | Path, spec: LayerSpec):
        self.root = Path(root)
        self.spec = spec
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, row: int) -> Path:
        return self.root / hs_name(row)

    def temp_path(self, row: int, tag: str) -> Path:
        """Where a backend writes row `row` before commit(): a file in a fresh temp directory."""
        scratch = self.root / f".{hs_name(row)}.{tag}.tmp"
        scratch.mkdir(exist_ok=True)
        return scratch / hs_name(row)

    def clean_temps(self, rows: range) -> list[str]:
        """Remove leftovers of interrupted writes for these rows (never other shards' rows)."""
        removed = []
        for entry in os.scandir(self.root):
            name = entry.name
            if not (name.startswith(".hs_") and ".safetensors." in name):
                continue
            index = name[len(".hs_"):name.index(".safetensors.")]
            if index.isdigit() and int(index) in rows:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:  # a temp file of atomic_write_bytes (transformers backend's write())
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
        """Serialize (in the spec's storage format) and write atomically (transformers backend)."""
        data = serialize_hs(row, hidden_states, self.spec)
        self._require_valid(row, data, "transformers backend")
        atomic_write_bytes(self.path(row.index), data)
        return FileRecord(row.index, len(row.input_ids), len(data), _sha256(data))

    def commit(self, row: Row, temp: Path, source: str = "vLLM output") -> FileRecord:
        """Validate a file a backend wrote under a temp name, then rename it into place.
        Thread-safe: concurrent commits of different rows share nothing."""
        data = temp.read_bytes()
        self._require_valid(row, data, f"{source} {temp.name}")
        with open(temp, "rb") as f:  # durable before it gets its final name
            os.fsync(f.fileno())
        os.replace(temp, self.path(row.index))
        if temp.parent != self.root:  # its temp directory (temp_path), now empty
            shutil.rmtree(temp.parent, ignore_errors=True)
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
# Each backend module registers its class here with @register("name").
# --------------------------------------------------------------------------------------

BACKENDS: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return deco


def backend_class(name: str):
    if name not in BACKENDS:
        raise PipelineError(f"hidden_states.backend = {name!r}: use one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
