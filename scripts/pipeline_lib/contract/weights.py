"""The draft's tensors: readable, the shapes its config implies (per draft type), finite."""
from __future__ import annotations

from .base import Check, Context, Family, NotRun

# The types whose tensor layout is written down here (measured on speculators 0.9.0
# checkpoints); the others get the checks every checkpoint passes (readable, finite).
FAMILY = Family("weights", applies_to={"eagle3", "peagle", "dflash"})


def expected_shapes(ctx: Context) -> tuple[dict[str, list[int]], set[str]]:
    """(required name -> shape, optional names) for a checkpoint of the variant's draft type,
    from its own config. EAGLE-3 and P-EAGLE: a decoder whose first layer reads [embedding,
    fused hidden state] (2H wide), P-EAGLE adds the learnt mask_hidden its parallel positions
    start from. DFlash: the fused context feeds every layer's keys (H wide), one top-level
    hidden_norm, no embed_tokens (vLLM shares the target's)."""
    cfg, tl = ctx.typed_config(), ctx.layer_config()
    kind = ctx.draft_type
    H = tl["hidden_size"]
    heads = tl["num_attention_heads"]
    kv = tl.get("num_key_value_heads") or heads
    hd = tl.get("head_dim") or H // heads
    inter = tl["intermediate_size"]
    V = tl["vocab_size"]
    dvs = cfg.get("draft_vocab_size") or V
    n_aux = len(ctx.aux_layer_ids() or [0, 0, 0])
    th = cfg.get("target_hidden_size") or H
    shapes = {"fc.weight": [H, n_aux * th], "lm_head.weight": [dvs, H], "norm.weight": [H]}
    optional = set()
    if kind != "dflash":
        shapes["embed_tokens.weight"] = [V, H]
        optional.add("embed_tokens.weight")  # vLLM shares the target's when absent
    else:
        shapes["hidden_norm.weight"] = [H]
    if kind == "peagle":
        shapes["mask_hidden"] = [1, 1, n_aux * th]
    if dvs != V:
        shapes.update({"d2t": [dvs], "t2d": [V]})
    if cfg.get("norm_before_fc"):
        shapes["input_norm.weight"] = [n_aux * th]
    if cfg.get("fc_norm"):
        shapes.update({f"fc_norm.{j}.weight": [th] for j in range(n_aux)})
    for i in range(tl.get("num_hidden_layers", 1)):
        p = f"layers.{i}."
        width = 2 * H if i == 0 and kind != "dflash" else H
        shapes.update({
            p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
            p + "self_attn.q_proj.weight": [heads * hd, width], p + "self_attn.k_proj.weight": [kv * hd, width],
            p + "self_attn.v_proj.weight": [kv * hd, width], p + "self_attn.o_proj.weight": [H, heads * hd],
            p + "mlp.gate_proj.weight": [inter, H], p + "mlp.up_proj.weight": [inter, H],
            p + "mlp.down_proj.weight": [H, inter]})
        if i == 0 and kind != "dflash":
            shapes[p + "hidden_norm.weight"] = [H]
        if tl.get("attention_bias"):
            shapes.update({p + "self_attn.q_proj.bias": [heads * hd], p + "self_attn.k_proj.bias": [kv * hd],
                           p + "self_attn.v_proj.bias": [kv * hd]})
        if tl.get("model_type") == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
    return shapes, optional


@FAMILY.check("weights.readable", every_draft_type=True)
def check_weights_readable(ctx: Context) -> Check:
    try:
        w = ctx.weights()
    except NotRun as err:
        return Check("weights.readable", False, "*.safetensors in the draft dir", None, str(err))
    return Check("weights.readable", True, "*.safetensors in the draft dir",
                 {"files": [f.name for f in w.files], "tensors": len(w.shapes)})


@FAMILY.check("weights.shapes")
def check_weight_shapes(ctx: Context) -> Check:
    w = ctx.weights()
    shapes, optional = expected_shapes(ctx)
    missing = sorted(n for n in shapes if n not in w.shapes and n not in optional)
    wrong = {n: {"expected": s, "seen": w.shapes[n]} for n, s in shapes.items() if n in w.shapes and w.shapes[n] != s}
    unexpected = sorted(n for n in w.shapes if n not in shapes)
    problems = []
    if missing:
        problems.append(f"missing: {missing}")
    if wrong:
        problems.append("wrong shape: " + ", ".join(f"{n} {v['seen']} (expected {v['expected']})" for n, v in wrong.items()))
    if unexpected:
        problems.append(f"unexpected (vLLM's loader rejects unknown weights): {unexpected}")
    return Check("weights.shapes", not problems, {"tensors": len(shapes), "from": "draft config + target sizes"},
                 {"missing": missing, "wrong_shape": wrong, "unexpected": unexpected}, "; ".join(problems))


@FAMILY.check("weights.finite", every_draft_type=True)
def check_finite(ctx: Context) -> Check:
    import torch

    w = ctx.weights()
    bad = {}
    for name in sorted(w.shapes):
        t = w.tensor(name)
        if t.is_floating_point():
            n_bad = int((~torch.isfinite(t)).sum())
            if n_bad:
                bad[name] = n_bad
    return Check("weights.finite", not bad, "no NaN/Inf in any tensor", bad or "all finite",
                 "" if not bad else "non-finite values (count per tensor); the checkpoint is corrupt or training diverged")
