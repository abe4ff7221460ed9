"""The target layers the draft reads (eagle_aux_hidden_state_layer_ids; the DFlash family's
aux_hidden_state_layer_ids): present, and the ones its training hidden states were extracted from."""
from __future__ import annotations

from .. import draft_types
from ..target import num_layers
from .base import Check, Context, Family, NotRun

# Every type that reads aux layers (all but MTP, which reads the final layer only).
FAMILY = Family("aux_layer_ids", applies_to={t.name for t in draft_types.DRAFT_TYPES.values() if t.aux_layers_key})


@FAMILY.check("aux_layer_ids.present")
def check_aux_present(ctx: Context) -> Check:
    ids = ctx.aux_layer_ids()
    key = draft_types.get(ctx.draft_type).aux_layers_key
    n = num_layers(ctx.target_config)
    ok = (isinstance(ids, list) and len(ids) > 0 and all(isinstance(i, int) for i in ids)
          and len(set(ids)) == len(ids) and all(0 <= i <= n for i in ids))
    detail = "" if ok else (
        f"{key} missing: vLLM silently falls back to default layers and "
        "acceptance collapses" if ids is None else f"layer ids must be distinct integers in 0..{n}")
    return Check("aux_layer_ids.present", ok, f"distinct layer ids in 0..{n}", ids, detail)


@FAMILY.check("aux_layer_ids.match_hidden_states")
def check_aux_match(ctx: Context) -> Check:
    ids = ctx.aux_layer_ids()
    if ids is None:
        raise NotRun(f"no {draft_types.get(ctx.draft_type).aux_layers_key} (see aux_layer_ids.present)")
    expected = ctx.hs_manifest.get("aux_layer_ids")
    ok = ids == expected
    detail = "" if ok else ("the draft reads other target layers than its training hidden states came from "
                            "(hidden_states/manifest.json); retrain, or fix the layer ids the draft was saved with")
    server = ctx.hs_manifest.get("server_layer_ids")
    if ok and server is not None and server != [*ids, ctx.hs_manifest.get("final_layer_id")]:
        # Online training: the server must have extracted exactly these aux layers, then the final one.
        ok, detail = False, (f"the online training server extracted layers {server}, not the draft's aux ids "
                             f"+ the final layer; retrain")
    return Check("aux_layer_ids.match_hidden_states", ok, expected, ids, detail)
