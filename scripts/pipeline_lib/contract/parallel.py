"""What a parallel-drafting type (P-EAGLE, the DFlash family, XPress) is trained to propose, and
the mask token its parallel positions start from. vLLM checks neither: asked for more tokens
than the draft was trained to fill it drafts them anyway (docs/draft-types.md), and a mask id
outside the vocabulary fails only at the first request."""
from __future__ import annotations

from .. import draft_types
from .base import Check, Context, Family, NotRun

FAMILY = Family("parallel_drafting", applies_to={t.name for t in draft_types.DRAFT_TYPES.values()
                                                 if t.parallel_drafting})


def _speculative_tokens(cfg: dict) -> int | None:
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods")
    if isinstance(methods, list) and methods and isinstance(methods[0], dict):
        return methods[0].get("speculative_tokens")
    return None


@FAMILY.check("parallel.speculative_tokens")
def check_speculative_tokens(ctx: Context) -> Check:
    """The k the variant is served with is at most what the draft was trained to propose, and
    a block type's count agrees with its block size (block - 1, or block with sample_from_anchor)."""
    cfg = ctx.typed_config()
    seen = _speculative_tokens(cfg)
    k = ctx.settings.get("num_speculative_tokens")
    if not isinstance(seen, int):
        raise NotRun("no speculators_config.proposal_methods[0].speculative_tokens (see config.proposal_methods)")
    problems = []
    if isinstance(k, int) and k > seen:
        problems.append(f"verify.num_speculative_tokens = {k}, but the draft was trained to propose {seen} per "
                        f"step: vLLM would draft positions it never learnt. Lower verify.num_speculative_tokens or "
                        f"retrain with a larger train.block_size / train.num_depths")
    block = cfg.get("block_size")
    if draft_types.get(ctx.draft_type).default_block_size is not None:
        if not isinstance(block, int):
            problems.append("block_size missing from config.json")
        else:
            implied = block if cfg.get("sample_from_anchor") else block - 1
            if seen != implied:
                problems.append(f"speculative_tokens {seen} disagrees with block_size {block} "
                                f"(sample_from_anchor {bool(cfg.get('sample_from_anchor'))}: {implied})")
    expected = {"served_k": k, "trained_tokens": f">= {k}"}
    return Check("parallel.speculative_tokens", not problems, expected,
                 {"speculative_tokens": seen, "block_size": block}, "; ".join(problems))


@FAMILY.check("parallel.mask_token_id")
def check_mask_token(ctx: Context) -> Check:
    """Set, inside the target's vocabulary; a fallback to the pad/eos token is named (the
    target has no mask token of its own: speculators' train/utils.py picks one)."""
    cfg = ctx.typed_config()
    seen = cfg.get("mask_token_id")
    vocab = ctx.tc.get("vocab_size")
    if not isinstance(seen, int) or isinstance(seen, bool) or not 0 <= seen < (vocab or 0):
        return Check("parallel.mask_token_id", False, f"a token id in 0..{(vocab or 0) - 1}", seen,
                     "mask_token_id missing or outside the target vocabulary: vLLM fills the parallel positions "
                     "with it; retrain (train_draft sets it from the tokenizer)")
    fallback = [name for name in ("pad_token_id", "eos_token_id", "bos_token_id")
                if ctx.tc.get(name) == seen or ctx.target_config.get(name) == seen]
    detail = (f"the target has no mask token: speculators used its {fallback[0].removesuffix('_id')} token "
              f"(id {seen}) as the mask") if fallback else ""
    return Check("parallel.mask_token_id", True, f"a token id in 0..{(vocab or 0) - 1}", seen, detail)
