"""Hidden-state extraction for speculators' EAGLE-3 training data.

Used by extract_hidden_states.py (one shard) and gather_hidden_states.py:
- store.py: LayerSpec (which layers are captured and in what dtype: aux ids in order, then the
  final layer N = the last decoder layer's output before the final norm); HSStore, the file
  store `<store>/<key>/hs_{row}.safetensors` (names, validation, atomic commits, cleanup of
  temp files an interrupted job left behind); the backend registry.
- formats.py: the storage formats (`hidden_states.storage`): bf16 (speculators' plain file) and
  fp8 (hs-connectors' per-token-scaled float8, quantized by hs-connectors' own function), with
  their validation, the speculators transfer that reads them and the vLLM connector that writes
  them.
- one module per backend, registered in BACKENDS: `vllm` (vllm_backend.py: offline LLM with
  speculators' extract_hidden_states method and a hidden-states KV connector) and
  `transformers` (transformers_backend.py: a forward pass with hooks on the needed layers
  only). Both write files with identical keys, shapes and dtypes in either storage format, so they are
  interchangeable; tests/test_hidden_states.py checks they agree within bf16 tolerance.

torch, transformers and vllm are imported inside the functions that need them, so bad input
is reported before any heavy import.
"""
from . import transformers_backend, vllm_backend  # noqa: F401  (each registers its backend)
from .formats import FORMATS, storage_format  # noqa: F401
from .store import (BACKENDS, DTYPES, STORE_FORMAT, FileRecord, HSStore, LayerSpec, Row,  # noqa: F401
                    backend_class, batches, hs_name, hs_tensors, inspect_hs_bytes, layer_spec, log_to_stderr,
                    serialize_hs, shard_range, store_key, token_batches)
from .vllm_backend import connector_config  # noqa: F401
