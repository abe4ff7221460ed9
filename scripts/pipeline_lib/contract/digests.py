"""The draft's training data was tokenized with the target's tokenizer and chat template
(digests the tokenize stage measured from what it loaded vs the target stage's)."""
from __future__ import annotations

from .base import Check, Context, Family

FAMILY = Family("training_data", applies_to=None)


def _digest_check(key: str) -> None:
    name = f"training_data.{key}"

    @FAMILY.check(name)
    def compare(ctx: Context) -> Check:
        expected, seen = ctx.target_manifest.get(key), ctx.stats.get(key)
        ok = expected is not None and seen == expected
        return Check(name, ok, expected, seen,
                     "" if ok else f"tokenized/stats.json {key} differs from target/manifest.json (or is missing): "
                                   f"the draft was trained on data tokenized for another tokenizer/template")


_digest_check("tokenizer_digest")
_digest_check("chat_template_digest")
