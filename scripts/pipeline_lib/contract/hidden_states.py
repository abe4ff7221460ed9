"""The hidden states the draft trained on: extracted from this target, and read through the
transfer their storage format needs."""
from __future__ import annotations

from .base import Check, Context, Family, NotRun

FAMILY = Family("hidden_states", applies_to=None)


@FAMILY.check("hidden_states.target_digest")
def check_hs_target(ctx: Context) -> Check:
    expected = ctx.target_manifest.get("weights_digest")
    seen = ctx.hs_manifest.get("target_digest")
    ok = expected is not None and seen == expected
    return Check("hidden_states.target_digest", ok, expected, seen,
                 "" if ok else "the training hidden states were extracted from another target (or its digest "
                               "is missing); rerun hidden-state extraction")


@FAMILY.check("hidden_states.read_as_stored")
def check_read_as_stored(ctx: Context) -> Check:
    """Training read the hidden states through speculators' transfer for their storage format:
    fp8 files read as plain files would train on unscaled fp8 values without any error."""
    from ..hidden_states.formats import FORMATS

    if ctx.hs_record is None:
        raise NotRun("no training hidden-states record (--hs-record, drafts/<variant>/hidden_states.json)")
    storage = ctx.hs_manifest.get("storage", "bf16")
    seen = {k: (ctx.hs_record or {}).get(k) for k in ("mode", "storage", "transfer")}
    expected = {"storage": storage, "transfer": FORMATS[storage].transfer_backend if storage in FORMATS else None}
    ok = expected["transfer"] is not None and all(seen[k] == v for k, v in expected.items())
    return Check("hidden_states.read_as_stored", ok, expected, seen,
                 "" if ok else "the trainer read the hidden states through another transfer than their storage "
                               "format needs (hidden_states.json vs the hidden-states manifest); retrain")
