"""The draft a run will train, as vLLM reads it, written without weights; and the reference
target shapes of the committed forecast table.

With `load_format: dummy` vLLM gives the target and the draft random weights, so a draft dir
needs only its config.json: built here with speculators' own config classes (the fields its
trainer writes), so vLLM reads it exactly as it reads a trained draft of the same settings."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import PipelineError

# Draft types the forecast can build: those vLLM serves as a chain or parallel EAGLE head from
# speculators' format (docs/draft-types.md). Their k: eagle3 proposes k tokens from one head run
# k times; peagle proposes them all in one pass (vLLM's parallel drafting).
FORECAST_TYPES = ("eagle3", "peagle")

# Target shapes people serve that fit one 80 GB GPU in bf16 (config.json fields; weights
# dummy). Vocabularies and layer counts from the models' published configs.
REFERENCE_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=30, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                         tie_word_embeddings=True, model_type="llama"),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=32, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                         tie_word_embeddings=False, model_type="llama"),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     num_hidden_layers=36, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                     tie_word_embeddings=False, model_type="qwen3"),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=40, num_key_value_heads=8,
                      num_hidden_layers=40, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                      tie_word_embeddings=False, model_type="qwen3"),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                      num_hidden_layers=64, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                      tie_word_embeddings=False, model_type="qwen3"),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def target_config(shape: dict, max_position_embeddings: int = 8192) -> dict:
    """A full config.json for a reference shape (the tokenizer comes from elsewhere: token ids
    above the tokenizer's vocabulary are never asked for)."""
    cfg = {"architectures": [ARCHITECTURES[shape["model_type"]]], "hidden_act": "silu",
           "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
           "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}
    cfg.update(shape)
    return cfg


def write_reference_target(name: str, tokenizer_dir: Path, out: Path) -> Path:
    """A target dir of a reference shape: its config.json and the tokenizer files of another
    model (what GuideLLM and vLLM's chat endpoint need). Weights: vLLM's dummy loader."""
    if name not in REFERENCE_SHAPES:
        raise PipelineError(f"unknown reference shape {name!r}; known: {', '.join(REFERENCE_SHAPES)}")
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(target_config(REFERENCE_SHAPES[name]), indent=1))
    return out


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """speculators' default (models/utils.resolve_target_layer_ids)."""
    return [2, num_layers // 2, num_layers - 3]


def write_draft_config(target: Path, out: Path, draft_type: str, draft_layers: int, draft_vocab_size: int,
                       k: int, aux_layer_ids: list[int] | None = None) -> Path:
    """config.json of the draft the run will train, for vLLM to load with dummy weights.

    `draft_vocab_size` larger than the target's vocabulary is capped to it (the trainer does the
    same: the draft cannot predict more tokens than the target has)."""
    if draft_type not in FORECAST_TYPES:
        raise PipelineError(f"forecast: train.draft_type = {draft_type!r}; the forecast builds "
                            f"{' and '.join(FORECAST_TYPES)} drafts (the types vLLM serves from speculators' "
                            f"format on any accelerator); set forecast.enabled: false for this run")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import DraftArgs
    from transformers import AutoConfig

    verifier = AutoConfig.from_pretrained(target)
    text = getattr(verifier, "text_config", None) or verifier
    aux = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(text.num_hidden_layers)
    # The decoder layer speculators' trainer builds for this type with its defaults (a copy of the
    # target's config would carry the target's per-layer lists: Qwen3's 64 layer_types for 1 layer).
    d = DraftArgs()
    layer_cfg = create_transformer_layer_config(
        str(target), draft_layers, d.draft_arch or ("llama" if draft_type == "eagle3" else "qwen3"),
        d.draft_hidden_act, d.sliding_window, list(d.full_attention_indices), d.draft_mrope_full_head_hack)
    common = dict(transformer_layer_config=layer_cfg, draft_vocab_size=min(draft_vocab_size, text.vocab_size),
                  norm_before_residual=True, eagle_aux_hidden_state_layer_ids=aux)
    verifier_cfg = VerifierConfig.from_pretrained(str(target))
    if draft_type == "eagle3":
        cls, extra = Eagle3SpeculatorConfig, {}
    else:
        from speculators.models.peagle import PEagleSpeculatorConfig
        cls, extra = PEagleSpeculatorConfig, {"mask_token_id": 0}
    config = cls(**common, **extra, speculators_config=SpeculatorsConfig(
        algorithm=draft_type, default_proposal_method="greedy", verifier=verifier_cfg,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)]))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    return out


def write_random_draft_weights(draft: Path) -> None:
    """Random weights for a draft config (speculators' own model class), for a server that
    loads the target's real weights and so the draft's too. Acceptance comes from the
    synthetic sampler, not from these values."""
    import torch
    from speculators import SpeculatorModel
    from speculators.config import SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(draft)
    torch.manual_seed(0)
    model = SpeculatorModel.registered_model_class_from_config(config)(config=config)
    model.save_pretrained(draft)
