"""The draft's config.json is what vLLM's speculators loader reads for a speculator of the
variant's draft type: type, architectures, version, proposal method, verifier path and
architectures, layer config, draft vocabulary size. Every field is common to speculators'
checkpoints; what differs by type (the architecture name, the decoder layers vLLM maps) comes
from the draft-type registry."""
from __future__ import annotations

import importlib.metadata
import os

from .. import draft_types
from .base import Check, Context, Family

FAMILY = Family("config", applies_to=None)

# An older name speculators gave EAGLE-3 checkpoints (the config default); vLLM keys on
# speculators_model_type, so it still loads.
LEGACY_ARCHITECTURES = {"eagle3": {"Eagle3Speculator"}}


@FAMILY.check("config.present", every_draft_type=True)
def check_config_present(ctx: Context) -> Check:
    ok = ctx.draft_config is not None
    return Check("config.present", ok, "config.json (speculators format)",
                 "present" if ok else ctx.config_error,
                 "" if ok else f"{ctx.draft}: no usable config.json; a speculators checkpoint dir holds "
                               f"config.json + model.safetensors. Was the draft saved with save_pretrained?")


def _title(name: str) -> str:
    return draft_types.DRAFT_TYPES[name].title if name in draft_types.DRAFT_TYPES else "unknown type"


@FAMILY.check("config.speculators_model_type")
def check_model_type(ctx: Context) -> Check:
    seen = ctx.config().get("speculators_model_type")
    expected = ctx.draft_type
    ok = seen == expected
    detail = "" if ok else (
        "no speculators_model_type: this is not a speculators checkpoint (vLLM would load it as a plain model)"
        if seen is None else
        f"this is a {seen!r} speculator ({_title(seen)}), but the variant's train.draft_type is {expected!r} "
        f"({_title(expected)}): vLLM would run it "
        f"as what it says it is. Point the draft at a {expected!r} checkpoint, or set train.draft_type: {seen}")
    return Check("config.speculators_model_type", ok, expected, seen, detail)


@FAMILY.check("config.architectures")
def check_architectures(ctx: Context) -> Check:
    seen = ctx.typed_config().get("architectures")
    expected = {draft_types.get(ctx.draft_type).architecture, *LEGACY_ARCHITECTURES.get(ctx.draft_type, ())}
    ok = isinstance(seen, list) and len(seen) == 1 and seen[0] in expected
    return Check("config.architectures", ok, sorted(expected), seen,
                 "" if ok else f"architectures must name speculators' {ctx.draft_type} model class")


@FAMILY.check("config.speculators_version")
def check_version(ctx: Context) -> Check:
    seen = ctx.typed_config().get("speculators_version")
    try:
        installed = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    ok = isinstance(seen, str) and bool(seen)
    detail = "" if ok else "speculators_version missing: the checkpoint was not written by speculators"
    if ok and installed and seen.split(".")[:2] != installed.split(".")[:2]:
        detail = f"written by speculators {seen}, installed {installed} (format may differ)"
    return Check("config.speculators_version", ok, f"a version string (installed: {installed})", seen, detail)


@FAMILY.check("config.proposal_methods")
def check_proposal(ctx: Context) -> Check:
    spec = ctx.typed_config().get("speculators_config") or {}
    methods = spec.get("proposal_methods")
    seen = methods[0].get("speculative_tokens") if isinstance(methods, list) and methods and isinstance(methods[0], dict) else None
    ok = isinstance(seen, int) and seen >= 1
    return Check("config.proposal_methods", ok, "speculators_config.proposal_methods[0].speculative_tokens >= 1",
                 seen, "" if ok else "vLLM reads the number of speculative tokens from proposal_methods[0]; "
                                     "it is missing or invalid")


def _verifier(ctx: Context) -> dict:
    return (ctx.typed_config().get("speculators_config") or {}).get("verifier") or {}


@FAMILY.check("config.verifier_path")
def check_verifier_path(ctx: Context) -> Check:
    name = _verifier(ctx).get("name_or_path")
    expected = os.path.relpath(ctx.target.resolve(), ctx.draft.resolve())
    if not isinstance(name, str) or not name:
        return Check("config.verifier_path", False, expected, name,
                     "speculators_config.verifier.name_or_path missing (vLLM's loader requires it)")
    if os.path.isabs(name):
        return Check("config.verifier_path", False, expected, name,
                     "absolute verifier path: it breaks when results/ moves; train_draft must store the "
                     "path relative to the draft dir (docs/artifacts.md)")
    resolved = (ctx.draft / name).resolve()
    ok = resolved.exists() and os.path.samefile(resolved, ctx.target)
    return Check("config.verifier_path", ok, expected, name,
                 "" if ok else f"resolves to {resolved}, which is not the target {ctx.target}")


@FAMILY.check("config.verifier_architectures")
def check_verifier_architectures(ctx: Context) -> Check:
    seen = _verifier(ctx).get("architectures")
    expected = ctx.target_config.get("architectures")
    ok = seen == expected
    return Check("config.verifier_architectures", ok, expected, seen,
                 "" if ok else "the draft was trained for another verifier architecture")


@FAMILY.check("config.transformer_layer_config")
def check_layer_config(ctx: Context) -> Check:
    tl = ctx.layer_config()
    tc = ctx.tc
    heads = tc.get("num_attention_heads")
    layer_types = draft_types.get(ctx.draft_type).vllm_layer_types
    expected = {"model_type": sorted(layer_types) if layer_types else "any", "hidden_size": tc.get("hidden_size"),
                "vocab_size": tc.get("vocab_size"), "num_attention_heads": heads,
                "num_key_value_heads": tc.get("num_key_value_heads", heads)}
    seen = {"model_type": tl.get("model_type"), "hidden_size": tl.get("hidden_size"),
            "vocab_size": tl.get("vocab_size"), "num_attention_heads": tl.get("num_attention_heads"),
            "num_key_value_heads": tl.get("num_key_value_heads", tl.get("num_attention_heads"))}
    problems = []
    if layer_types and seen["model_type"] not in layer_types:
        problems.append(f"model_type {seen['model_type']!r} has no vLLM {ctx.draft_type} model "
                        f"(supported: {sorted(layer_types)})")
    target_hidden = ctx.typed_config().get("target_hidden_size") or seen["hidden_size"]
    if target_hidden != expected["hidden_size"]:
        problems.append(f"target hidden size {target_hidden} != the target's {expected['hidden_size']}")
    if seen["hidden_size"] != expected["hidden_size"]:
        problems.append(f"hidden_size {seen['hidden_size']} != the target's {expected['hidden_size']} "
                        f"(the draft shares the target's embeddings)")
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads"):
        if seen[key] != expected[key]:
            problems.append(f"{key} {seen[key]} != the target's {expected[key]}")
    return Check("config.transformer_layer_config", not problems, expected, seen, "; ".join(problems))


@FAMILY.check("config.draft_vocab_size")
def check_draft_vocab(ctx: Context) -> Check:
    seen = ctx.typed_config().get("draft_vocab_size")
    vocab = ctx.tc.get("vocab_size")
    ok = isinstance(seen, int) and 1 <= seen <= (vocab or 0)
    return Check("config.draft_vocab_size", ok, f"1..{vocab} (target vocab)", seen,
                 "" if ok else "draft_vocab_size missing or larger than the target's vocabulary")
