"""Reading a materialized target: its (text) config, layer count, aux layer ids, digests.

Multimodal targets nest the language model's config under `text_config` and its weights
under a `language_model.` prefix; every reader here goes through text_config().

The digests (weights, tokenizer, chat template) are computed by the target stage for its
manifest and again by each stage that loads those files (tokenize, hidden states) from what
it actually loaded, so the contract checks compare two measurements, not a value with its
own copy."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .digests import file_digest, json_digest, text_digest
from .errors import PipelineError
from .io import read_json

# What the tokenizer digest covers, besides tokenizer_config.json minus its chat template:
# the files AutoTokenizer reads.
TOKENIZER_FILES = ["tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json"]


def load_config(target_dir: str | Path) -> dict[str, Any]:
    path = Path(target_dir) / "config.json"
    if not path.exists():
        raise PipelineError(f"{path}: target has no config.json; is {target_dir} a HF model dir?")
    return read_json(path, "target config")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def num_layers(config: dict[str, Any]) -> int:
    return int(text_config(config)["num_hidden_layers"])


def default_aux_layer_ids(n_layers: int) -> list[int]:
    """speculators' default: early, middle and late residual streams."""
    return [2, n_layers // 2, n_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, n_layers: int, setting: str = "hidden_states.aux_layer_ids") -> list[int]:
    ids = default_aux_layer_ids(n_layers) if configured is None else list(configured)
    origin = "speculators' default for a {}-layer target".format(n_layers) if configured is None else setting
    if len(set(ids)) != len(ids):
        raise PipelineError(f"{setting} = {ids}: duplicated layer ids ({origin}); give distinct ids"
                            + (" (targets with 6 or fewer layers need explicit ids)" if configured is None else ""))
    if ids != sorted(ids):
        raise PipelineError(f"{setting} = {ids}: layer ids must be in increasing order; use {sorted(ids)}")
    bad = [i for i in ids if i < 1 or i >= n_layers]
    if bad:
        raise PipelineError(f"{setting} = {ids}: ids {bad} out of range for a target with "
                            f"{n_layers} layers (valid: 1..{n_layers - 1}); the final layer "
                            f"({n_layers}) is always added")
    return ids


def load_manifest(path: str | Path) -> dict[str, Any]:
    return read_json(path, "target manifest")


def has_chat_template(target_dir: str | Path) -> bool:
    d = Path(target_dir)
    if (d / "chat_template.jinja").exists() or (d / "chat_template.json").exists():
        return True
    tok_cfg = d / "tokenizer_config.json"
    return tok_cfg.exists() and bool(read_json(tok_cfg, "tokenizer config").get("chat_template"))


def tokenizer_digest(model_dir: str | Path) -> str:
    """The tokenizer files of a model dir (tokenizer_config.json without its chat template)."""
    model_dir = Path(model_dir)
    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = read_json(tok_cfg_path, "tokenizer config") if tok_cfg_path.exists() else {}
    tok_cfg.pop("chat_template", None)
    parts: dict[str, Any] = {"tokenizer_config.json": tok_cfg}
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            parts[name] = file_digest(model_dir / name)
    return json_digest(parts)


def chat_template_digest(template: str | dict) -> str:
    """Digest of the template text exactly as the tokenizer loads it (what tokenize renders with)."""
    return text_digest(template) if isinstance(template, str) else json_digest(template)


def weights_digest(model_dir: str | Path, file_digests: dict[str, str] | None = None) -> str:
    """The *.safetensors files of a model dir, by name and content; `file_digests` ({name:
    digest}) reuses digests already computed instead of reading the files again."""
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    if not weights:
        raise PipelineError(f"{model_dir}: no *.safetensors weights; rerun the target stage")
    known = file_digests or {}
    return json_digest(sorted([p.name, known.get(p.name) or file_digest(p)] for p in weights))


def loaded_weights_digest(target_dir: str | Path, manifest_path: str | Path) -> str:
    """The digest of the weight files a job loads (hashed there, not copied from the manifest:
    the contract checks compare it with the target stage's); refuses a model dir whose weights
    changed after the target stage. Reading them once more also warms the page cache for the
    engine's load."""
    recorded = load_manifest(manifest_path).get("weights_digest")
    if not recorded:
        raise PipelineError(f"{manifest_path}: no weights_digest; rerun the target rule")
    loaded = weights_digest(target_dir)
    if loaded != recorded:
        raise PipelineError(f"{target_dir}: its weight files differ from the ones in {manifest_path} (the model "
                            f"dir changed after the target stage); rerun the target stage")
    return loaded
