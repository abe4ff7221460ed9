"""Decontamination: the n-gram test that keeps evaluation prompts out of training (and, at
measurement time, finds an eval suite's overlap with the training prompts)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .formats import Counts, Prompt

WORD = re.compile(r"\w+")


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The text's n-grams of lower-cased words, in order."""
    words = WORD.findall(text.lower())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def prompt_texts(p: Prompt) -> list[str]:
    """What a conversation asks: its opening (system and user messages) and every later user turn."""
    return [m["content"] for m in p.messages] + [t["user"] for t in (p.turns or [])[1:]]


@dataclass
class Decontamination:
    """The eval source's n-grams, and which training rows shared one (summary examples)."""
    n: int
    eval_ngrams: set[tuple[str, ...]]
    against: dict[str, Any]
    examples: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def from_prompts(cls, n: int, prompts: list[Prompt], against: dict[str, Any]) -> "Decontamination":
        """The n-grams of every user (and system) turn of `prompts`; `against` describes them."""
        grams: set[tuple[str, ...]] = set()
        for p in prompts:
            for text in prompt_texts(p):
                grams.update(ngrams(text, n))
        return cls(n, grams, against)

    def shared_ngram(self, p: Prompt) -> tuple[str, ...] | None:
        """The first n-gram of p's user (and system) turns that is also in the set, or None."""
        return next((g for text in prompt_texts(p) for g in ngrams(text, self.n) if g in self.eval_ngrams), None)

    def filter(self, prompts: list[Prompt], counts: Counts) -> list[Prompt]:
        kept = []
        for p in prompts:
            shared = self.shared_ngram(p)
            if shared is None:
                kept.append(p)
            elif len(self.examples) < 20:
                self.examples.append({"id": f"{p.label}:{p.key}", "ngram": " ".join(shared)})
        counts.extra["contaminated_dropped"] = len(prompts) - len(kept)
        return kept

    def summary(self) -> dict[str, Any]:
        return {"ngram": self.n, "against": self.against, "eval_ngrams": len(self.eval_ngrams),
                "examples": self.examples}

