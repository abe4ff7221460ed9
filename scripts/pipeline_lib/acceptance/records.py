"""Step records -> numbers, shared by every backend: each backend produces RequestRecords
(greedy output + the accepted/drafted count of every verify step); everything after that
(summaries, categories, spans, greedy equality) is computed here, so all outputs share one
schema."""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class RequestRecord:
    """One prompt's greedy output and, with speculation, the accepted/drafted count of every
    verify step in order (step j drafts the output tokens right after the ones emitted so far)."""

    id: str
    category: str | None
    token_ids: list[int]
    finish_reason: str | None = None
    steps_accepted: list[int] | None = None
    steps_drafted: list[int] | None = None
    # The draft's proposals (target token ids) at every verify step, where the backend sees them.
    steps_proposals: list[list[int]] | None = None


def acceptance_block(num_drafts: int, num_draft_tokens: int, accepted_per_pos: list[int]) -> dict[str, Any]:
    accepted = int(sum(accepted_per_pos))
    return {
        "num_drafts": int(num_drafts),
        "num_draft_tokens": int(num_draft_tokens),
        "num_accepted_tokens": accepted,
        "accepted_per_position": [int(x) for x in accepted_per_pos],
        # EAGLE's tau: tokens emitted per target forward (accepted drafts + the target's own token).
        "mean_acceptance_length": (1.0 + accepted / num_drafts) if num_drafts else None,
        "acceptance_rate_per_position": [x / num_drafts for x in accepted_per_pos] if num_drafts else None,
        "draft_acceptance_rate": accepted / num_draft_tokens if num_draft_tokens else None,
    }


def steps_block(steps: list[tuple[int, int]], k: int) -> dict[str, Any]:
    """Acceptance numbers from (accepted, drafted) verify steps."""
    per_pos = [0] * k
    for accepted, _ in steps:
        for i in range(min(accepted, k)):
            per_pos[i] += 1
    return acceptance_block(len(steps), sum(d for _, d in steps), per_pos)


def request_steps(rec: RequestRecord) -> list[tuple[int, int]]:
    return list(zip(rec.steps_accepted or [], rec.steps_drafted or []))


def per_category(records: list[RequestRecord], k: int) -> dict[str, dict]:
    groups: dict[str, list] = collections.defaultdict(list)
    for rec in records:
        groups[rec.category or "uncategorized"] += request_steps(rec)
    out = {}
    for cat in sorted(groups):
        block = steps_block(groups[cat], k)
        block["prompts"] = sum(1 for r in records if (r.category or "uncategorized") == cat)
        out[cat] = block
    return out


def step_span(rec: RequestRecord, end_token_id: int) -> list[str]:
    """The span ('reasoning' | 'answer' | 'no_end_marker') each verify step drafted in.

    The first output token comes from the prefill; step j drafts from output position
    1 + sum_{i<j}(accepted_i + 1) on. A step is attributed to the span of the first token it
    had to guess; the end marker itself counts as reasoning."""
    try:
        end = rec.token_ids.index(end_token_id)
    except ValueError:
        return ["no_end_marker"] * len(rec.steps_accepted or [])
    spans, pos = [], 1
    for accepted in rec.steps_accepted or []:
        spans.append("reasoning" if pos <= end else "answer")
        pos += accepted + 1
    return spans


def per_span(records: list[RequestRecord], k: int, end_token_id: int) -> dict[str, dict]:
    groups: dict[str, list] = {"reasoning": [], "answer": [], "no_end_marker": []}
    counts = collections.Counter()
    for rec in records:
        spans = step_span(rec, end_token_id)
        for span, step in zip(spans, request_steps(rec)):
            groups[span].append(step)
        counts["no_end_marker" if end_token_id not in rec.token_ids else "with_end_marker"] += 1
    out = {span: steps_block(steps, k) for span, steps in groups.items()}
    out["prompts"] = dict(counts)
    return out


def greedy_equality(with_draft: list[RequestRecord], without: list[RequestRecord]) -> dict[str, Any]:
    """Token-by-token comparison of greedy outputs with and without speculation, prompt by prompt
    (matched by id: the untrained baseline may run on a subset)."""
    mismatches = []
    by_id = {r.id: r for r in without}
    pairs = [(a, by_id[a.id]) for a in with_draft if a.id in by_id]
    for a, b in pairs:
        if a.token_ids == b.token_ids:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
        mismatches.append({"id": a.id, "first_mismatch_index": first,
                           "with_draft_tokens": len(a.token_ids), "without_draft_tokens": len(b.token_ids),
                           "with_draft_next": a.token_ids[first:first + 5],
                           "without_draft_next": b.token_ids[first:first + 5]})
    n = len(pairs)
    return {"compared": n, "identical": n - len(mismatches), "mismatches": mismatches,
            "passed": not mismatches}


def request_summaries(records: list[RequestRecord]) -> list[dict]:
    out = []
    for rec in records:
        steps = request_steps(rec)
        accepted = sum(a for a, _ in steps)
        out.append({"id": rec.id, "category": rec.category, "output_tokens": len(rec.token_ids),
                    "finish_reason": rec.finish_reason, "num_drafts": len(steps), "num_accepted_tokens": accepted,
                    "mean_acceptance_length": (1 + accepted / len(steps)) if steps else None,
                    "steps_accepted": rec.steps_accepted})
    return out


@dataclass
class RunResult:
    """One configuration (trained | untrained | no_draft) of one backend."""

    records: list[RequestRecord]
    wall_s: float
    global_block: dict | None = None    # the engine's own counters, when it has them (with "source")
    batched: bool = False               # records came from one concurrent batch (batch throughput)
    concurrency_one: list[RequestRecord] | None = None
    concurrency_one_wall_s: float | None = None
    engine_start_s: float | None = None
    # The backend's proof of its own exactness, when it has one (acceptance.json "self_check").
    self_check: dict | None = None
    parts_s: dict[str, float] | None = None  # where the run's seconds went, when the backend splits them
    # Where per-request steps came from when not from the engine's per-request metrics (vLLM 0.26).
    per_request_source: str | None = None


class BackendFailure(Exception):
    """The backend could not run a configuration (e.g. vLLM refused the draft). Recorded in
    acceptance.json (the report shows it); not a crash of the measurement script."""

    def __init__(self, run: str, message: str, log_tail: list[str] | None = None):
        super().__init__(message)
        self.run = run
        self.message = message
        self.log_tail = log_tail or []


@dataclass
class Backend:
    """One backend's three measurements, each `(spec, engine_script=...)`:
    `no_draft` -> (RunResult, notes): the target alone, greedy (the shared baseline job);
    `drafts` -> ({"trained": RunResult, "untrained": RunResult}, notes): speculation with each draft;
    `speedup` -> (rounds, cost): interleaved timed rounds without / with the trained draft
    (speedup.run_rounds), and what keeping both up cost."""

    no_draft: Callable[..., "tuple[RunResult, list[str]]"] | None = None
    drafts: Callable[..., "tuple[dict[str, RunResult], list[str]]"] | None = None
    speedup: Callable[..., "tuple[list[dict], dict]"] | None = None


# Backends by settings.backend value. A new backend is one module that registers both parts here.
BACKENDS: dict[str, Backend] = {}


def register(name: str, part: str) -> Callable[[Callable], Callable]:
    if part not in ("no_draft", "drafts", "speedup"):
        raise ValueError(f"backend part {part!r}: use no_draft, drafts or speedup")

    def wrap(fn: Callable) -> Callable:
        setattr(BACKENDS.setdefault(name, Backend()), part, fn)
        return fn
    return wrap


def run_to_json(run: RunResult) -> dict[str, Any]:
    return dataclasses.asdict(run)


def run_from_json(data: dict[str, Any]) -> RunResult:
    def records(rows):
        return None if rows is None else [RequestRecord(**r) for r in rows]

    return RunResult(**{**data, "records": records(data["records"]),
                        "concurrency_one": records(data["concurrency_one"])})
