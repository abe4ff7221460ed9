"""The draft's input embeddings are the target's (random ones are a silent failure)."""
from __future__ import annotations

import json
from pathlib import Path

from .base import Check, Context, Family, NotRun, safetensors_files

# EAGLE-3 keeps the target's embeddings frozen. P-EAGLE trains its own (embed_requires_grad),
# and the DFlash family stores none (vLLM shares the target's): nothing to compare.
FAMILY = Family("embeddings", applies_to={"eagle3"})

# Where a target keeps its input embeddings (plain, and nested multimodal layouts).
EMBED_NAMES = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "embed_tokens.weight"]


def target_embeddings(target: Path):
    """The target's input embedding matrix (plain or nested multimodal layout)."""
    from safetensors import safe_open

    index = target / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {n: target / f for n, f in weight_map.items()}
    else:
        where = {}
        for f in safetensors_files(target):
            with safe_open(str(f), framework="pt") as st:
                where.update({n: f for n in st.keys()})
    name = next((n for n in EMBED_NAMES if n in where), None)
    if name is None:
        name = next((n for n in where if n.endswith("embed_tokens.weight")), None)
    if name is None:
        raise NotRun(f"{target}: no embed_tokens weight found among the target's tensors")
    with safe_open(str(where[name]), framework="pt") as st:
        return name, st.get_tensor(name)


@FAMILY.check("embeddings.match_target")
def check_embeddings(ctx: Context) -> Check:
    import torch

    w = ctx.weights()
    if "embed_tokens.weight" not in w.shapes:
        return Check("embeddings.match_target", True, "the target's embed_tokens", "absent",
                     "the draft has no embed_tokens; vLLM shares the target's")
    name, ref = target_embeddings(ctx.target)
    emb = w.tensor("embed_tokens.weight")
    if list(emb.shape) != list(ref.shape):
        return Check("embeddings.match_target", False, list(ref.shape), list(emb.shape),
                     f"shape differs from the target's {name}")
    # Compare at the lower precision of the two: a bf16 copy of fp32 weights is still "equal".
    low = min((emb.dtype, ref.dtype), key=lambda d: torch.finfo(d).bits)
    a, b = emb.to(low), ref.to(low)
    equal_rows = (a == b).all(dim=1)
    diff = float((emb.float() - ref.float()).abs().max())
    ok = bool(equal_rows.all())
    seen = {"rows_equal": int(equal_rows.sum()), "rows": int(emb.shape[0]), "max_abs_diff": diff}
    return Check("embeddings.match_target", ok, f"equal to target {name}", seen,
                 "" if ok else "the draft's embeddings are not the target's (random or from another model): "
                               "a known silent failure, acceptance collapses; load them from the verifier")
