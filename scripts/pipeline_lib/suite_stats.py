"""Per-suite figures from per-request acceptance records: bootstrap confidence intervals over
prompts, paired bootstrap differences between two variants, and degenerate answers (empty, or
ending in a short repeating loop).

A request here is a dict with at least "id", "num_drafts" and "num_accepted_tokens" (the
acceptance.json `requests` rows); "suite" and "category" group them.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np

BASE_SUITE = "eval"   # prompts/eval.jsonl (prompts.eval plus held-out training prompts)
SUITE_SEP = "/"       # suite prompt ids are "<suite>/<row id>": unique across suites


# ------------------------------------------------------------------------------------ tau

def tau(drafts: np.ndarray, accepted: np.ndarray) -> float | None:
    """EAGLE's mean acceptance length over a set of prompts: 1 + accepted / drafts (pooled)."""
    total = drafts.sum()
    return float(1.0 + accepted.sum() / total) if total else None


def bootstrap_interval(drafts: Iterable[int], accepted: Iterable[int], samples: int = 1000, seed: int = 0,
                       level: float = 0.95) -> list[float] | None:
    """Percentile bootstrap interval of tau: resample prompts with replacement (`samples`
    times, seeded), pooled tau of each resample. None with fewer than 2 prompts with drafts."""
    d, a = np.asarray(list(drafts), dtype=float), np.asarray(list(accepted), dtype=float)
    if (d > 0).sum() < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(samples, len(d)))
    sd, sa = d[idx].sum(axis=1), a[idx].sum(axis=1)
    taus = 1.0 + sa[sd > 0] / sd[sd > 0]
    lo, hi = np.percentile(taus, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return [round(float(lo), 4), round(float(hi), 4)]


def paired_difference(a: list[dict], b: list[dict], samples: int = 1000, seed: int = 0,
                      level: float = 0.95) -> dict[str, Any] | None:
    """tau(b) - tau(a) on the prompts both measured (paired by id), with a paired percentile
    bootstrap interval (the same resampled prompts for both). `differs` when the interval
    excludes 0. None when fewer than 2 prompts are shared."""
    by_id = {r["id"]: r for r in a if r.get("num_drafts")}
    pairs = [(by_id[r["id"]], r) for r in b if r["id"] in by_id and r.get("num_drafts")]
    if len(pairs) < 2:
        return None
    da, aa, db, ab = (np.array([float(p[i][k]) for p in pairs]) for i, k in
                      ((0, "num_drafts"), (0, "num_accepted_tokens"), (1, "num_drafts"), (1, "num_accepted_tokens")))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pairs), size=(samples, len(pairs)))
    diffs = ab[idx].sum(1) / db[idx].sum(1) - aa[idx].sum(1) / da[idx].sum(1)
    lo, hi = np.percentile(diffs, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    point = ab.sum() / db.sum() - aa.sum() / da.sum()
    return {"prompts": len(pairs), "difference": round(float(point), 4),
            "interval": [round(float(lo), 4), round(float(hi), 4)], "differs": bool(lo > 0 or hi < 0)}


def group_figures(requests: list[dict], samples: int, seed: int) -> dict[str, Any]:
    """tau and its interval over a group of requests."""
    d = np.array([r.get("num_drafts") or 0 for r in requests], dtype=float)
    a = np.array([r.get("num_accepted_tokens") or 0 for r in requests], dtype=float)
    value = tau(d, a)
    return {"prompts": len(requests), "mean_acceptance_length": round(value, 4) if value is not None else None,
            "interval": bootstrap_interval(d, a, samples, seed)}


def suite_figures(requests: list[dict], samples: int = 1000, seed: int = 0) -> dict[str, dict]:
    """Per suite: tau with its interval, per category, and with/without degenerate answers."""
    by_suite: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        by_suite[r.get("suite") or BASE_SUITE].append(r)
    out = {}
    for suite, rows in by_suite.items():
        cats: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            cats[r.get("category") or "uncategorized"].append(r)
        clean = [r for r in rows if not r.get("degenerate")]
        degenerate = [r for r in rows if r.get("degenerate")]
        out[suite] = {
            **group_figures(rows, samples, seed),
            "per_category": {c: group_figures(v, samples, seed) for c, v in sorted(cats.items())},
            "degenerate": {"count": len(degenerate),
                           "empty": sum(r["degenerate"]["kind"] == "empty" for r in degenerate),
                           "loop": sum(r["degenerate"]["kind"] == "loop" for r in degenerate),
                           "answers": [{"id": r["id"], **r["degenerate"]} for r in degenerate]},
            "without_degenerate": group_figures(clean, samples, seed),
        }
    return out


# ----------------------------------------------------------------------- degenerate answers

DEGENERATE_DEFAULTS = {"max_period": 16, "min_repeats": 4, "min_tokens": 16}


def tail_loop(token_ids: list[int], max_period: int = 16, min_repeats: int = 4,
              min_tokens: int = 16) -> dict[str, int] | None:
    """The answer ends in a loop when its last tokens are one pattern of `period` <=
    max_period tokens repeated at least min_repeats times, covering at least min_tokens tokens
    (a trailing partial copy of the pattern counts). The smallest such period wins; returns
    {period, repeats, loop_tokens, start} or None."""
    n = len(token_ids)
    for period in range(1, max_period + 1):
        if n < 2 * period:
            break
        # Walk back while each token equals the one a period later.
        i = n - period - 1
        while i >= 0 and token_ids[i] == token_ids[i + period]:
            i -= 1
        covered = n - (i + 1)
        repeats = covered // period
        if repeats >= min_repeats and covered >= min_tokens:
            return {"period": period, "repeats": repeats, "loop_tokens": covered, "start": i + 1}
    return None


def degenerate_answer(token_ids: list[int], settings: dict) -> dict[str, Any] | None:
    """{"kind": "empty"} for an answer without tokens, {"kind": "loop", ...tail_loop} for a
    looping tail, else None."""
    if not token_ids:
        return {"kind": "empty"}
    loop = tail_loop(token_ids, **{k: settings.get(k, v) for k, v in DEGENERATE_DEFAULTS.items()})
    return {"kind": "loop", **loop} if loop else None
