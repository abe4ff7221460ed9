"""The data-scaling curve of the variant comparison: variants that differ only in
train.max_conversations (the nested subsets of one run's conversations), tau per eval suite
against the number of conversations each draft trained on, with its bootstrap interval, and
the gain per added conversation of the last step (the two largest sizes: the paired bootstrap
difference of tau divided by the conversations added)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..io import get_in
from ..render import Section, Table, fmt
from ..suite_stats import BASE_SUITE, paired_difference

PLOT = "Mean acceptance length against training conversations"
SIZE_KEY = "train.max_conversations"


def requests_by_suite(report: dict) -> dict[str, list[dict]]:
    """The trained draft's acceptance requests of a verification.json, by eval suite."""
    out: dict[str, list[dict]] = {}
    for r in get_in(report, "acceptance", "requests", "trained") or []:
        out.setdefault(r.get("suite") or BASE_SUITE, []).append(r)
    return out


@dataclass
class Curve:
    """Variants equal in every setting but the subset size, smallest first."""
    others: dict[str, Any]                          # the settings they share that differ from the base config
    points: list[dict[str, Any]] = field(default_factory=list)   # per variant: size, counts, tau per suite
    last_step: list[dict[str, Any]] = field(default_factory=list)  # per suite: the gain of the last step


def scaling_curves(reports: list[dict]) -> list[Curve]:
    """One curve per group of variants whose settings differ only in max_conversations and
    that trained on at least two different numbers of conversations."""
    groups: dict[str, list[dict]] = {}
    for v in reports:
        if get_in(v, "training", "training_data", "conversations") is None:
            continue  # a draft from before training_data was recorded: its size is unknown
        others = {k: val for k, val in (get_in(v, "lineage", "changed_settings") or {}).items() if k != SIZE_KEY}
        groups.setdefault(json.dumps(others, sort_keys=True), []).append(v)
    curves = []
    for key, members in groups.items():
        size = {m["variant"]: m["training"]["training_data"]["conversations"] for m in members}
        if len(set(size.values())) < 2:
            continue
        members.sort(key=lambda m: (size[m["variant"]], m["variant"]))
        curve = Curve(json.loads(key))
        for m in members:
            used = m["training"]["training_data"]
            figures = get_in(m, "suites", "trained", "figures") or {}
            curve.points.append({
                "variant": m["variant"], "conversations": used["conversations"], "of": used.get("of_conversations"),
                "rows": used.get("rows"), "train_rows": used.get("train_rows"), "tokens": used.get("tokens"),
                "suites": {s: {"tau": f["mean_acceptance_length"], "interval": f.get("interval"),
                               "label": (get_in(m, "suites", "labels") or {}).get(s, s)} for s, f in figures.items()}})
        # The last step: the first variant at the second-largest size against the first at the largest.
        largest = max(size.values())
        below = max(s for s in size.values() if s < largest)
        a = next(m for m in members if size[m["variant"]] == below)
        b = next(m for m in members if size[m["variant"]] == largest)
        boot = get_in(a, "suites", "bootstrap") or {"samples": 1000, "seed": 0}
        base = requests_by_suite(a)
        for suite, rows in sorted(requests_by_suite(b).items()):
            diff = paired_difference(base.get(suite, []), rows, boot["samples"], boot["seed"])
            if diff:
                added = largest - below
                curve.last_step.append({
                    "suite": suite, "from": a["variant"], "to": b["variant"], "from_conversations": below,
                    "to_conversations": largest, "added": added, **diff,
                    "per_conversation": diff["difference"] / added,
                    "per_conversation_interval": [x / added for x in diff["interval"]]})
        curves.append(curve)
    return curves


def _label(curve: Curve, suite: str) -> str:
    return next((p["suites"][suite]["label"] for p in curve.points if suite in p["suites"]), suite)


def _suites(curve: Curve) -> list[str]:
    return sorted({s for p in curve.points for s in p["suites"]})


def sections(curves: list[Curve]) -> list[Section]:
    if not curves:
        return []
    tables = []
    for curve in curves:
        suites = _suites(curve)

        def tau(point: dict, s: str) -> str:
            f = point["suites"].get(s)
            if not f:
                return "n/a"
            return fmt(f["tau"]) + (f" [{f['interval'][0]:.3f}, {f['interval'][1]:.3f}]" if f.get("interval") else "")

        group = "; ".join(f"{k}={fmt(v)}" for k, v in curve.others.items()) or "(base config)"
        tables.append(Table(
            ["variant", "other settings", "conversations", "rows (train)", "tokens",
             *(f"{_label(curve, s)}: tau [95%]" for s in suites)],
            [[p["variant"], group, f"{p['conversations']} of {p['of']}", f"{p['rows']} ({p['train_rows']})",
              fmt(p["tokens"]), *(tau(p, s) for s in suites)] for p in curve.points]))
        if curve.last_step:
            tables.append(Table(
                ["suite", "last step", "added conversations", "tau difference [95%, paired]",
                 "gain per added conversation [95%]", "per 1,000 added"],
                [[_label(curve, d["suite"]), f"{d['from']} ({d['from_conversations']}) -> {d['to']} "
                  f"({d['to_conversations']})", d["added"], f"{fmt(d['difference'])} {fmt(d['interval'])}",
                  f"{d['per_conversation']:.2e} [{d['per_conversation_interval'][0]:.2e}, "
                  f"{d['per_conversation_interval'][1]:.2e}]",
                  f"{1000 * d['per_conversation']:.3f} [{1000 * d['per_conversation_interval'][0]:.3f}, "
                  f"{1000 * d['per_conversation_interval'][1]:.3f}]"] for d in curve.last_step]))
    return [Section("Data scaling: acceptance against training conversations", [
        "Variants that differ only in train.max_conversations train on nested subsets of the same run's "
        "conversations (sharing its traces, tokenized data and hidden states): tau per eval suite against the "
        "number of conversations (with 95% bootstrap intervals; the validation split is train_data_ratio of "
        "each subset's rows), then the last step: the paired bootstrap difference of tau between the two "
        "largest sizes on the prompts both measured, divided by the conversations added. An interval of the "
        "gain that includes 0 means the last step bought nothing measurable."], tables, [PLOT])]


def plot(curves: list[Curve]) -> str | None:
    """tau against conversations, one line per suite (and curve), bootstrap intervals as error bars."""
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..render import png

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for curve in curves:
        tag = "; ".join(f"{k}={v}" for k, v in curve.others.items())
        for s in _suites(curve):
            pts = [(p["conversations"], p["suites"][s]) for p in curve.points if s in p["suites"]]
            xs, ys = [x for x, _ in pts], [f["tau"] for _, f in pts]
            err = [[y - (f["interval"] or [y, y])[0] for y, (_, f) in zip(ys, pts)],
                   [(f["interval"] or [y, y])[1] - y for y, (_, f) in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=_label(curve, s) + (f" ({tag})" if tag else ""))
    sizes = [p["conversations"] for c in curves for p in c.points]
    if max(sizes) >= 4 * min(sizes):
        ax.set_xscale("log")
    ax.set(xlabel="training conversations", ylabel="mean acceptance length", title=PLOT)
    ax.legend(fontsize="small")
    return png(fig)
