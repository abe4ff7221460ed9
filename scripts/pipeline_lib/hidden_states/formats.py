"""How hidden states are stored on disk (`hidden_states.storage`), one class per format.

Both formats are what hs-connectors' transfers read, so speculators' trainer loads them with its
own code:
- `bf16`: speculators' plain file (`file` transfer): `hidden_states` [T, layers, H] in the
  extraction dtype (hidden_states.dtype, bfloat16 by default) and `token_ids` int64 [T].
- `fp8`: hs-connectors' FP8 file (`fp8` transfer, `FP8Transfer` dequantizes on read):
  `hidden_states` float8_e4m3fn [T, layers, H], `hidden_states_scales` float32 [T, 1, 1] (one
  scale per token) and `token_ids`. Quantized by hs-connectors' own `quantize_tensor_to_fp8`,
  whichever backend extracted the states (vLLM's FP8 connector calls the same function).

A format says: how to serialize a tensor, why a file is not valid for a row, what the file
header must look like (for checks that do not read the data), which speculators transfer
backend reads it, which vLLM KV connector writes it, and its bytes per token (for the plan).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import PipelineError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# safetensors' dtype names, as in a file header
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}


def all_finite(tensor) -> bool:
    """True when no value is NaN or +-inf. min/max propagate NaN and surface an infinity, and
    one aminmax pass reads bf16 ~20x faster than isfinite().all() on CPU: this check runs on
    every byte the store writes or revalidates."""
    import torch

    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


class PlainFormat:
    """Unquantized: hidden states in the extraction dtype."""

    name = "bf16"
    transfer_backend = "file"   # speculators --hidden-states-backend / hs-connectors registry
    # vLLM kv_connector per device; the CPU one lives in pipeline_lib.cpu_hs_connector
    cuda_connector = ("ExampleHiddenStatesConnector", None)
    cpu_connector = ("CpuHiddenStatesConnector", "pipeline_lib.cpu_hs_connector")
    tensor_names = ("hidden_states", "token_ids")

    def stored_dtype(self, dtype: str) -> str:
        return dtype

    def bytes_per_token(self, layers: int, hidden: int, dtype: str) -> int:
        """Hidden-state bytes per token (the int64 token id and the file header add a little)."""
        return layers * hidden * DTYPE_BYTES[dtype]

    def to_tensors(self, hidden_states, token_ids) -> dict[str, Any]:
        return {"hidden_states": hidden_states.contiguous(), "token_ids": token_ids}

    def inspect_values(self, tensors: dict[str, Any], dtype: str) -> str | None:
        """Why the (already shape-checked) hidden-state tensors are unusable, or None."""
        import torch

        hs = tensors["hidden_states"]
        if hs.dtype != getattr(torch, dtype):
            return f"hidden_states dtype {hs.dtype}, expected {dtype} (storage {self.name})"
        if not all_finite(hs):
            return "hidden_states has non-finite values"
        return None

    def header_problem(self, header: dict[str, Any], tokens: int, shape: list[int], dtype: str) -> str | None:
        """Why a file's safetensors header does not fit this format and row, or None."""
        want = {"token_ids": ("I64", [tokens]), "hidden_states": (SAFETENSORS_DTYPES[self.stored_dtype(dtype)], shape)}
        for name, (st_dtype, st_shape) in want.items():
            got = header.get(name) or {}
            if (got.get("dtype"), got.get("shape")) != (st_dtype, st_shape):
                return f"{name} shape {got.get('shape')} ({got.get('dtype')}), expected shape {st_shape} ({st_dtype})"
        return None


class FP8Format(PlainFormat):
    """hs-connectors' per-token-scaled float8_e4m3fn."""

    name = "fp8"
    transfer_backend = "fp8"
    cuda_connector = ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")
    cpu_connector = ("CpuFP8HiddenStatesConnector", "pipeline_lib.cpu_hs_connector")
    tensor_names = ("hidden_states", "hidden_states_scales", "token_ids")

    def stored_dtype(self, dtype: str) -> str:
        return "float8_e4m3fn"

    def bytes_per_token(self, layers: int, hidden: int, dtype: str) -> int:
        return layers * hidden + 4  # fp8 values + one fp32 scale

    def to_tensors(self, hidden_states, token_ids) -> dict[str, Any]:
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

        fp8, scales = quantize_tensor_to_fp8(hidden_states)
        return {"hidden_states": fp8.contiguous(), SCALES_KEY: scales.contiguous(), "token_ids": token_ids}

    def inspect_values(self, tensors: dict[str, Any], dtype: str) -> str | None:
        import torch

        hs, scales = tensors["hidden_states"], tensors.get("hidden_states_scales")
        if hs.dtype != torch.float8_e4m3fn:
            return f"hidden_states dtype {hs.dtype}, expected torch.float8_e4m3fn (storage fp8)"
        if scales is None:
            return "missing tensor hidden_states_scales (storage fp8)"
        if scales.dtype != torch.float32 or list(scales.shape) != [hs.shape[0], 1, 1]:
            return (f"hidden_states_scales is {scales.dtype} {list(scales.shape)}, expected torch.float32 "
                    f"[{hs.shape[0]}, 1, 1]")
        if not bool((torch.isfinite(scales) & (scales > 0)).all()):
            return "hidden_states_scales has non-finite or non-positive values"
        # float8_e4m3fn has NaN but no inf; NaN is what a non-finite input quantizes to.
        if bool(torch.isnan(hs.float()).any()):
            return "hidden_states has non-finite values"
        return None

    def header_problem(self, header: dict[str, Any], tokens: int, shape: list[int], dtype: str) -> str | None:
        problem = super().header_problem(header, tokens, shape, dtype)
        scales = header.get("hidden_states_scales") or {}
        if problem is None and (scales.get("dtype"), scales.get("shape")) != ("F32", [tokens, 1, 1]):
            problem = (f"hidden_states_scales shape {scales.get('shape')} ({scales.get('dtype')}), expected "
                       f"shape {[tokens, 1, 1]} (F32)")
        return problem


FORMATS: dict[str, PlainFormat] = {f.name: f for f in (PlainFormat(), FP8Format())}


def storage_format(name: str) -> PlainFormat:
    if name not in FORMATS:
        raise PipelineError(f"hidden_states.storage = {name!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[name]


def inspect_tensors(tensors: dict[str, Any], input_ids: Sequence[int], layers: int, hidden: int, dtype: str,
                    storage: str) -> str | None:
    """Why loaded tensors are not a valid hidden-states file for this row, or None."""
    import torch

    fmt = storage_format(storage)
    missing = {"token_ids", "hidden_states"} - tensors.keys()
    if missing:
        return f"missing tensors {sorted(missing)}"
    token_ids, hs = tensors["token_ids"], tensors["hidden_states"]
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        return f"token_ids is {token_ids.dtype} {list(token_ids.shape)}, expected int64 [T]"
    if token_ids.tolist() != list(input_ids):
        return "token_ids differ from the dataset's input_ids"
    expected = [len(input_ids), layers, hidden]
    if list(hs.shape) != expected:
        return f"hidden_states shape {list(hs.shape)}, expected {expected}"
    extra = sorted(set(tensors) - set(fmt.tensor_names))
    if extra:
        return f"unexpected tensors {extra} for storage {fmt.name} (tensors of another storage format?)"
    return fmt.inspect_values(tensors, dtype)
