"""The filters a synthesized request passes, in order (FILTERS: name -> filter class). Each
sees only what the filters before it kept and counts what it drops, so the summary's counts
add up: candidates = kept + the sum of the drops.

  failed            the backend returned an error for it
  unfinished        it did not end its turn within max_tokens (a cut-off request)
  template_markers  it emitted a special token before its end of turn (e.g. a role header:
                    the model wrote on into the assistant's turn), or spells out markup (the
                    tokenizer's special tokens, `markers`)
  length            fewer than min_words or more than max_words words
  language          a cheap heuristic, not language identification: letters must be at least
                    min_letter_share of the non-space characters and ASCII letters at least
                    min_ascii_letter_share of the letters (English-leaning text; code and
                    maths with few letters fail it too)
  refusal           it matches one of refusal_patterns (the model answered as an assistant,
                    e.g. "I'm sorry, but I can't ...", instead of writing a request)
  duplicate         its word dedup_ngram-grams overlap an earlier kept request's by Jaccard
                    similarity >= max_ngram_overlap (exact repeats included)
  contaminated      it shares a decontamination_ngram-word n-gram with a prompt of any eval
                    suite (prompts.eval, prompts.decontaminate_with, verify.suites)
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..cli import reject_unknown_keys
from ..errors import PipelineError
from ..prompts.decontamination import WORD, Decontamination
from ..prompts.formats import Prompt

EXAMPLES = 5  # dropped requests shown per filter in the summary


@dataclass
class FilterContext:
    """The `synthesize.filters` settings, the template markers the shards found in the
    target's tokenizer, and the eval suites' n-grams."""
    min_words: int = 4
    max_words: int = 200
    min_letter_share: float = 0.6
    min_ascii_letter_share: float = 0.9
    dedup_ngram: int = 3
    max_ngram_overlap: float = 0.6
    refusal_patterns: list[str] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)
    decontamination: Decontamination | None = None

    @classmethod
    def from_settings(cls, filters: dict[str, Any], markers: list[str],
                      decontamination: Decontamination | None) -> "FilterContext":
        known = set(cls.__dataclass_fields__) - {"decontamination"}
        reject_unknown_keys(filters, known | {"decontamination_ngram"}, "synthesize.filters")
        values = {k: v for k, v in filters.items() if k in known}
        ctx = cls(**{**values, "markers": sorted(set(values.get("markers") or []) | set(markers))},
                  decontamination=decontamination)
        if ctx.min_words > ctx.max_words:
            raise PipelineError(f"synthesize.filters.min_words = {ctx.min_words} > max_words = {ctx.max_words}; "
                                f"no request could pass")
        for pattern in ctx.refusal_patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise PipelineError(f"synthesize.filters.refusal_patterns: {pattern!r} is not a regular "
                                    f"expression ({err})") from None
        return ctx


class Filter:
    """keep(candidate) -> True to pass it on. A candidate: {id, text, finish_reason, error,
    special_tokens_emitted, topic}."""

    def __init__(self, ctx: FilterContext):
        self.ctx = ctx

    def keep(self, c: dict[str, Any]) -> bool:
        raise NotImplementedError


class Failed(Filter):
    def keep(self, c):
        return c["finish_reason"] != "error"


class Unfinished(Filter):
    def keep(self, c):
        return c["finish_reason"] == "stop"


class TemplateMarkers(Filter):
    def keep(self, c):
        return not c.get("special_tokens_emitted") and not any(m in c["text"] for m in self.ctx.markers)


class Length(Filter):
    def keep(self, c):
        return self.ctx.min_words <= len(WORD.findall(c["text"])) <= self.ctx.max_words


def letter_shares(text: str) -> tuple[float, float]:
    """(letters / non-space characters, ASCII letters / letters); (0, 0) without letters."""
    letters = [ch for ch in text if ch.isalpha()]
    visible = sum(not ch.isspace() for ch in text)
    if not letters:
        return 0.0, 0.0
    return len(letters) / visible, sum(ch.isascii() for ch in letters) / len(letters)


class Language(Filter):
    def keep(self, c):
        letters, ascii_letters = letter_shares(c["text"])
        return letters >= self.ctx.min_letter_share and ascii_letters >= self.ctx.min_ascii_letter_share


class Refusal(Filter):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.patterns = [re.compile(p, re.IGNORECASE) for p in ctx.refusal_patterns]

    def keep(self, c):
        return not any(p.search(c["text"]) for p in self.patterns)


class Duplicate(Filter):
    """Near-duplicates through an inverted index of the kept requests' n-grams."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self.sizes: list[int] = []

    def grams(self, text: str) -> set[tuple[str, ...]]:
        words = WORD.findall(text.lower())
        n = self.ctx.dedup_ngram
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)} or {tuple(words)}

    def keep(self, c):
        grams = self.grams(c["text"])
        shared = Counter(k for g in grams for k in self.postings.get(g, ()))
        for k, common in shared.items():
            if common / (len(grams) + self.sizes[k] - common) >= self.ctx.max_ngram_overlap:
                return False
        k = len(self.sizes)
        self.sizes.append(len(grams))
        for g in grams:
            self.postings[g].append(k)
        return True


class Contaminated(Filter):
    def keep(self, c):
        d = self.ctx.decontamination
        return d is None or d.shared_ngram(Prompt(c["id"], [{"role": "user", "content": c["text"]}])) is None


FILTERS: dict[str, type[Filter]] = {
    "failed": Failed,
    "unfinished": Unfinished,
    "template_markers": TemplateMarkers,
    "length": Length,
    "language": Language,
    "refusal": Refusal,
    "duplicate": Duplicate,
    "contaminated": Contaminated,
}


def apply_filters(candidates: list[dict[str, Any]], ctx: FilterContext) -> tuple[list[dict], dict[str, Any]]:
    """(kept candidates in order, {filter: {"dropped", "examples"}})."""
    report: dict[str, Any] = {}
    for name, cls in FILTERS.items():
        f = cls(ctx)
        kept, dropped = [], []
        for c in candidates:
            (kept if f.keep(c) else dropped).append(c)
        report[name] = {"dropped": len(dropped),
                        "examples": [{"id": c["id"], "text": (c["text"] or c.get("error") or "")[:200]}
                                     for c in dropped[:EXAMPLES]]}
        candidates = kept
    return candidates, report
