"""The draft types of the variant comparison side by side: when the variants train more than one
train.draft_type (EAGLE-3, P-EAGLE, DFlash, ...) on the same data, rank them per eval suite by
tau with its 95% interval and paired bootstrap differences (against the EAGLE-3 variant, and
against the variant ranked just above: is the order beyond chance?), and list what each costs
and buys: parameters, training time, the speedup measured at concurrency 1 and at the batch."""
from __future__ import annotations

from typing import Any

from .. import draft_types
from ..io import get_in
from ..render import Section, Table, fmt
from ..suite_stats import paired_difference
from .scaling import requests_by_suite
from .throughput import speedup_text


def draft_type(report: dict) -> str:
    return get_in(report, "training", "draft_type") or "eagle3"


def compared(reports: list[dict]) -> bool:
    return len({draft_type(r) for r in reports}) > 1


def _count(n: int | None) -> str:
    return f"{n:,}" if n is not None else "n/a"


def _diff_text(diff: dict | None) -> str:
    if not diff:
        return "n/a"
    lo, hi = diff["interval"]
    return f"{diff['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + (" *" if diff["differs"] else "")


def rankings(reports: list[dict]) -> dict[str, list[dict[str, Any]]]:
    """Per suite, the variants by tau (highest first), each with its interval and its paired
    differences against the reference (the first EAGLE-3 variant) and the variant above."""
    boot = get_in(reports[0], "suites", "bootstrap") or {"samples": 1000, "seed": 0}
    reference = next((r for r in reports if draft_type(r) == "eagle3"), reports[0])
    requests = {r["variant"]: requests_by_suite(r) for r in reports}
    suites = sorted({s for r in reports for s in (get_in(r, "suites", "trained", "figures") or {})})
    out: dict[str, list[dict[str, Any]]] = {}
    for suite in suites:
        rows = []
        for r in reports:
            fig = (get_in(r, "suites", "trained", "figures") or {}).get(suite)
            if fig and fig.get("mean_acceptance_length") is not None:
                rows.append({"variant": r["variant"], "type": draft_type(r), "tau": fig["mean_acceptance_length"],
                             "interval": fig.get("interval"),
                             "label": (get_in(r, "suites", "labels") or {}).get(suite, suite)})
        rows.sort(key=lambda row: -row["tau"])
        for i, row in enumerate(rows):
            mine = requests[row["variant"]].get(suite, [])
            row["rank"] = i + 1
            row["vs_reference"] = (None if row["variant"] == reference["variant"] else
                                   paired_difference(requests[reference["variant"]].get(suite, []), mine,
                                                     boot["samples"], boot["seed"]))
            row["vs_above"] = (None if i == 0 else
                               paired_difference(requests[rows[i - 1]["variant"]].get(suite, []), mine,
                                                 boot["samples"], boot["seed"]))
        out[suite] = rows
    return out


def cost_rows(reports: list[dict]) -> list[dict[str, Any]]:
    out = []
    for r in reports:
        t = get_in(r, "acceptance", "throughput") or {}
        params = get_in(r, "training", "draft_parameters") or {}
        c1 = (t.get("concurrency_1") or {}).get("speedup")
        out.append({"variant": r["variant"], "type": draft_type(r), "speedup_c1_value": c1,
                    "parameters": params.get("without_embeddings"), "parameters_total": params.get("total"),
                    "train_step_s": get_in(r, "training", "train_step_s"),
                    "speedup_concurrency_1": speedup_text(t.get("concurrency_1")) if t else "n/a",
                    "speedup_batch": speedup_text(t.get("batch")) if t else "n/a"})
    # Ranked by the measured speedup at concurrency 1 (what a user of one stream gets); a
    # speedup not measured (rounds that disagree, ...) ranks last.
    return sorted(out, key=lambda c: (c["speedup_c1_value"] is None, -(c["speedup_c1_value"] or 0)))


def sections(reports: list[dict]) -> list[Section]:
    if not compared(reports):
        return []
    reference = next((r["variant"] for r in reports if draft_type(r) == "eagle3"), reports[0]["variant"])
    ref_type = draft_type(next(r for r in reports if r["variant"] == reference))
    tables = []
    for suite, rows in rankings(reports).items():
        label = rows[0]["label"] if rows else suite
        tables.append(Table(
            ["rank", "variant", "draft type", f"{label}: tau [95%]", f"vs {reference} (paired) [95%]",
             "vs the one above (paired) [95%]"],
            [[row["rank"], row["variant"], draft_types.get(row["type"]).title,
              fmt(row["tau"]) + (f" [{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]" if row["interval"] else ""),
              "(reference)" if row["variant"] == reference else _diff_text(row["vs_reference"]),
              "" if row["rank"] == 1 else _diff_text(row["vs_above"])] for row in rows]))
    tables.append(Table(
        ["variant", "draft type", "parameters (without embeddings)", "parameters (all tensors)", "training steps, all epochs",
         "speedup at concurrency 1 [95%]", "speedup at the batch [95%]"],
        [[c["variant"], draft_types.get(c["type"]).title, _count(c["parameters"]), _count(c["parameters_total"]),
          f"{c['train_step_s']:.1f} s" if c["train_step_s"] is not None else "n/a",
          c["speedup_concurrency_1"], c["speedup_batch"]] for c in cost_rows(reports)]))
    return [Section("Draft types compared", [
        f"The variants train {len({draft_type(r) for r in reports})} draft types on the same traces, tokens and "
        f"hidden states and are measured by the same acceptance job in vLLM on the same prompts. Per eval suite, "
        f"the variants ranked by mean acceptance length (tau) with its 95% bootstrap interval, the paired "
        f"bootstrap difference against {reference} (the {draft_types.get(ref_type).title} reference) and against "
        f"the variant ranked just "
        f"above, on the prompts both measured; * marks a difference whose 95% interval excludes 0 (an order "
        f"without * is within chance). A parallel type (P-EAGLE, DFlash) drafts its k tokens in one forward "
        f"pass where EAGLE-3 runs k passes, so equal tau is not equal cost: the last table, ranked by the speedup at concurrency 1, gives each "
        f"draft's parameters (P-EAGLE trains its embeddings too; EAGLE-3 keeps a frozen copy of the target's; "
        f"DFlash stores none), the time of its training steps over all epochs (speculators' step timer) and the "
        f"speedup measured in interleaved rounds. "
        f"Validation losses are not comparable across types: DFlash trains with cross-entropy, the others with "
        f"KL divergence to the target (speculators' per-type defaults); tau is the common measure."], tables)]
