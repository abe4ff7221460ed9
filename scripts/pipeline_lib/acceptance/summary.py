"""The acceptance.json body from the backends' RunResults."""
from __future__ import annotations

from typing import Any

from .inputs import MeasureSpec
from .records import RunResult, greedy_equality, per_category, per_span, request_steps, request_summaries, \
    steps_block


def assemble(spec: MeasureSpec, backend: str, runs: dict[str, RunResult], notes: list[str],
             reasoning_marker: str | None, throughput: dict[str, Any]) -> dict[str, Any]:
    """The acceptance.json body (minus the header measure_acceptance.py adds); throughput:
    the speedup rounds' (speedup.throughput)."""
    k = spec.num_speculative_tokens
    acceptance, consistency = {}, {}
    for name in ("trained", "untrained"):
        run = runs[name]
        from_requests = steps_block([s for r in run.records for s in request_steps(r)], k)
        if run.global_block is not None:
            acceptance[name] = dict(run.global_block)
            if run.per_request_source:  # a second pass, one prompt at a time: its sums need not match the batch's
                consistency[name] = {"matches": None, "per_request_source": run.per_request_source}
            else:
                consistency[name] = {
                    key: {"global": run.global_block[key], "sum_of_requests": from_requests[key]}
                    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                consistency[name]["matches"] = all(v["global"] == v["sum_of_requests"]
                                                   for v in consistency[name].values())
        else:
            acceptance[name] = dict(from_requests, source=f"{backend}:verify steps")
        acceptance[name]["output_tokens"] = sum(len(r.token_ids) for r in run.records)
        acceptance[name]["prompts"] = len(run.records)

    base = runs["no_draft"]
    spans = None
    if spec.reasoning_end_token_id is not None:
        spans = {"end_marker": reasoning_marker, "end_marker_token_id": spec.reasoning_end_token_id,
                 "trained": per_span(runs["trained"].records, k, spec.reasoning_end_token_id),
                 "untrained": per_span(runs["untrained"].records, k, spec.reasoning_end_token_id)}

    return {
        "acceptance": acceptance,
        "consistency": consistency or None,
        "per_category": {name: per_category(runs[name].records, k) for name in ("trained", "untrained")},
        "spans": spans,
        "throughput": throughput,
        "greedy_equality": {name: greedy_equality(runs[name].records, base.records)
                            for name in ("trained", "untrained")},
        "requests": {"trained": request_summaries(runs["trained"].records),
                     "untrained": request_summaries(runs["untrained"].records)},
        "timing": {"engine_start_s": {n: r.engine_start_s for n, r in runs.items() if r.engine_start_s is not None},
                   "generate_wall_s": {n: round(r.wall_s, 4) for n, r in runs.items()},
                   "parts_s": {n: r.parts_s for n, r in runs.items() if r.parts_s} or None},
        "self_check": {n: r.self_check for n, r in runs.items() if r.self_check is not None} or None,
        "notes": notes,
    }
