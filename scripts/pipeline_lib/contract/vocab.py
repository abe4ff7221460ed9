"""The draft vocabulary's maps to and from the target's (d2t, t2d)."""
from __future__ import annotations

from .base import Check, Context, Family

# Every type with a reduced draft vocabulary stores the same d2t/t2d maps (MTP has none).
FAMILY = Family("vocab_maps", applies_to={"eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress"})


@FAMILY.check("vocab_maps")
def check_vocab_maps(ctx: Context) -> Check:
    import torch

    cfg, tl = ctx.typed_config(), ctx.layer_config()
    w = ctx.weights()
    V, dvs = tl.get("vocab_size"), cfg.get("draft_vocab_size")
    if dvs == V and "d2t" not in w.shapes:
        return Check("vocab_maps", True, "no d2t/t2d (draft vocab = target vocab)", "none", "full vocabulary")
    if "d2t" not in w.shapes or "t2d" not in w.shapes:
        return Check("vocab_maps", False, "d2t and t2d tensors", sorted(n for n in ("d2t", "t2d") if n in w.shapes),
                     f"draft_vocab_size {dvs} < vocab {V} needs d2t/t2d; without them vLLM maps draft ids to the "
                     f"first {dvs} target ids (silently wrong)")
    d2t, t2d = w.tensor("d2t").long(), w.tensor("t2d").bool()
    mapped = torch.arange(d2t.shape[0]) + d2t
    problems = []
    if list(d2t.shape) != [dvs]:
        problems.append(f"d2t has {d2t.shape[0]} entries, draft_vocab_size is {dvs}")
    if list(t2d.shape) != [V]:
        problems.append(f"t2d has {t2d.shape[0]} entries, target vocab is {V}")
    if int(t2d.sum()) != dvs:
        problems.append(f"t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {dvs}")
    outside = ((mapped < 0) | (mapped >= V)).nonzero().flatten().tolist()
    if outside:
        problems.append(f"{len(outside)} draft ids map outside the target vocab [0, {V}) "
                        f"(e.g. draft id {outside[0]} -> {int(mapped[outside[0]])})")
    if len(set(mapped.tolist())) != len(mapped):
        problems.append("d2t maps two draft ids to the same target id")
    if not problems and not bool(t2d[mapped].all()):
        problems.append("d2t and t2d disagree (a mapped target id is not marked in t2d)")
    seen = {"d2t": list(d2t.shape), "t2d": list(t2d.shape), "t2d_true": int(t2d.sum()),
            "mapped_min": int(mapped.min()), "mapped_max": int(mapped.max())}
    return Check("vocab_maps", not problems, {"d2t": [dvs], "t2d": [V], "t2d_true": dvs,
                                              "mapped_range": [0, V - 1]}, seen, "; ".join(problems))
