"""Optional side-by-side comparison with a reference draft (e.g. a published one): config
fields and weight layout; differences are informational."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..assets import resolve_asset
from ..io import read_json
from .base import Check, Context, Weights

REFERENCE_FIELDS = ["speculators_model_type", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                    "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                    "transformer_layer_config.model_type", "transformer_layer_config.hidden_size",
                    "transformer_layer_config.num_hidden_layers", "transformer_layer_config.num_attention_heads",
                    "transformer_layer_config.num_key_value_heads", "transformer_layer_config.intermediate_size",
                    "transformer_layer_config.vocab_size",
                    "speculators_config.proposal_methods.0.speculative_tokens",
                    "speculators_config.verifier.architectures"]


def _field(cfg: dict | None, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
    return value


def compare_reference(ctx: Context, ref_setting: str) -> tuple[list[Check], dict]:
    try:
        ref_dir = Path(resolve_asset(ref_setting))
    except FileNotFoundError as err:
        ref_dir = Path(ref_setting)
        why = str(err)
    else:
        why = f"{ref_dir}/config.json not found"
    if not (ref_dir / "config.json").exists():
        msg = f"settings verify.reference_draft = {ref_setting!r}: {why}; give a speculators checkpoint dir"
        return [Check("reference_draft.config", False, "a checkpoint dir", ref_setting, msg, required=False)], \
            {"path": ref_setting, "error": msg}
    ref_cfg = read_json(ref_dir / "config.json", "reference draft config")
    rows = [{"field": f, "draft": _field(ctx.draft_config, f), "reference": _field(ref_cfg, f)} for f in REFERENCE_FIELDS]
    for r in rows:
        r["same"] = r["draft"] == r["reference"]
    differing = [r["field"] for r in rows if not r["same"]]
    checks = [Check("reference_draft.config", not differing, "same config fields as the reference",
                    {"differing": differing}, "differences are listed in contract.json reference.fields; "
                    "informational" if differing else "", required=False)]
    report: dict[str, Any] = {"path": str(ref_dir), "fields": rows}
    try:
        ours, theirs = ctx.weights().shapes, Weights(ref_dir).shapes
        weights = {"only_in_draft": sorted(set(ours) - set(theirs)), "only_in_reference": sorted(set(theirs) - set(ours)),
                   "shape_differs": {n: {"draft": ours[n], "reference": theirs[n]}
                                     for n in sorted(set(ours) & set(theirs)) if ours[n] != theirs[n]}}
        same = not any(weights.values())
        checks.append(Check("reference_draft.weights", same, "same weight names and shapes as the reference",
                            weights, "" if same else "layouts differ (informational)", required=False))
        report["weights"] = weights
    except Exception as err:
        checks.append(Check("reference_draft.weights", None, None, None, f"not run: {err}", required=False))
    return checks, report
