#!/usr/bin/env python
"""All draft variants side by side, from each variant's report/verification.json: what the
variant changes (settings that differ from the base config) and which stage instances it is
built from, verdict, contract result, mean acceptance length (trained and untrained),
per-position acceptance rates, speedup, and the selected epoch's validation loss and
per-position accuracies. Variants of more than one train.draft_type also get the draft types
ranked per suite with paired intervals, and their parameters, training time and speedup
(pipeline_lib/report/type_ranking.py); variants that differ only in train.max_conversations the
data-scaling table and plot (pipeline_lib/report/scaling.py).

Writes the table as CSV (one row per variant), and as comparison.md and a self-contained
comparison.html with a plot of the mean acceptance length per variant.

    python scripts/compare_variants.py --reports R/drafts/*/report/verification.json \\
        --out R/drafts/comparison.csv --markdown R/drafts/comparison.md --html R/drafts/comparison.html
"""
from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_text, get_in, read_json  # noqa: E402
from pipeline_lib.render import Section, Table, fmt, png, render_html, render_markdown  # noqa: E402
from pipeline_lib.report import scaling, type_ranking  # noqa: E402
from pipeline_lib.report.throughput import speedup_text  # noqa: E402
from pipeline_lib.suite_stats import paired_difference  # noqa: E402

PLOT = "Mean acceptance length per variant"
# Columns of the readable table and their headers (the CSV has every column).
SUMMARY_COLUMNS = {"variant": "variant", "draft_type": "draft type", "changed_settings": "settings changed from the base config",
                   "verdict": "verdict", "mean_acceptance_length_trained": "mean acceptance length: trained",
                   "mean_acceptance_length_untrained": "untrained", "acceptance_rates_trained":
                   "trained: acceptance rate per position", "val_loss": "validation loss",
                   "speedup_shown": "speedup [95%] or why not measured",
                   "traces": "traces", "tokenized": "tokenized", "hidden_states": "hidden states"}
CATEGORY_PREFIX = "mean_acceptance_length_trained:"
SUITE_PREFIX = "suite:"


def stage_columns(instances: dict[str, str]) -> dict[str, str]:
    """The stage instance directories, in the table's (DAG) order."""
    ordered = [c for c in SUMMARY_COLUMNS if c in instances] + sorted(set(instances) - set(SUMMARY_COLUMNS))
    return {stage: instances[stage] for stage in ordered}


def variant_row(path: Path) -> dict[str, Any]:
    v = read_json(path, "verification report")
    if "variant" not in v or "verdict" not in v:
        raise PipelineError(f"{path}: not a verification.json written by make_report.py (no variant/verdict)")
    acc = v.get("acceptance") or {}
    lineage = v.get("lineage") or {}
    row: dict[str, Any] = {
        "variant": v["variant"],
        "draft_type": get_in(v, "training", "draft_type") or "eagle3",
        "changed_settings": "; ".join(f"{k}={fmt(val)}" for k, val in (lineage.get("changed_settings") or {}).items()),
        **stage_columns(lineage.get("stage_instances") or {}),
        "verdict": "PASS" if v["verdict"].get("passed") else "FAIL",
        "contract_passed": get_in(v, "contract", "passed"),
        "acceptance_status": acc.get("status"),
        "backend": acc.get("backend"),
        "num_speculative_tokens": acc.get("num_speculative_tokens"),
        "num_prompts": acc.get("num_prompts"),
        "mean_acceptance_length_trained": get_in(acc, "acceptance", "trained", "mean_acceptance_length"),
        "mean_acceptance_length_untrained": get_in(acc, "acceptance", "untrained", "mean_acceptance_length"),
    }
    for name in ("trained", "untrained"):
        for i, rate in enumerate(get_in(acc, "acceptance", name, "acceptance_rate_per_position") or []):
            row[f"acceptance_rate_pos{i}_{name}"] = rate
    for category, result in sorted((get_in(acc, "per_category", "trained") or {}).items()):
        row[f"{CATEGORY_PREFIX}{category}"] = result.get("mean_acceptance_length")
    for suite, s in (get_in(v, "suites", "trained", "figures") or {}).items():
        row[f"{SUITE_PREFIX}{suite}"] = s["mean_acceptance_length"]
        row[f"{SUITE_PREFIX}{suite}:interval_low"], row[f"{SUITE_PREFIX}{suite}:interval_high"] = \
            s["interval"] or (None, None)
        row[f"{SUITE_PREFIX}{suite}:degenerate"] = s["degenerate"]["count"]
        row[f"{SUITE_PREFIX}{suite}:label"] = (get_in(v, "suites", "labels") or {}).get(suite, suite)
    t = get_in(acc, "throughput") or {}
    row["speedup"] = t.get("speedup")
    row["speedup_measured_at"] = t.get("speedup_measured_at")
    # Interval or reason: what the summary table shows (a figure a load change made is not one).
    row["speedup_shown"] = speedup_text(t.get(t["speedup_measured_at"])) if t.get("speedup_measured_at") else "n/a"
    for key in ("batch", "concurrency_1"):
        entry = t.get(key) or {}
        row[f"speedup_{key}"] = entry.get("speedup")
        row[f"speedup_{key}_interval_low"], row[f"speedup_{key}_interval_high"] = \
            entry.get("interval") if entry.get("speedup") is not None else (None, None)
        row[f"speedup_{key}_not_measured"] = entry.get("reason")
    training = v.get("training") or {}
    used = training.get("training_data") or {}
    for key in ("conversations", "of_conversations", "rows", "train_rows", "tokens", "train_tokens"):
        row[f"trained_on_{key}"] = used.get(key)
    row["selected_epoch"] = training.get("selected_epoch")
    row["draft_parameters"] = (training.get("draft_parameters") or {}).get("without_embeddings")
    row["train_step_s"] = training.get("train_step_s")
    for key, value in (training.get("selected_val") or {}).items():
        row[f"val_{key}"] = value
    row["thresholds_failed"] = ";".join(t["name"] for t in v.get("thresholds", []) if t.get("status") == "FAIL")
    return row


def acceptance_plot(rows: list[dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(names) + 2), 3.4))
    for offset, which in ((-0.2, "trained"), (0.2, "untrained")):
        ax.bar([x + offset for x in xs], [r.get(f"mean_acceptance_length_{which}") or 0 for r in rows],
               width=0.4, label=f"{which} draft")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(xs, names, rotation=30, ha="right")
    ax.set(ylabel="mean acceptance length", title=PLOT)
    ax.legend()
    return png(fig)


def differences(reports: list[dict]) -> list[dict[str, Any]]:
    """Each variant against the first, per suite: the paired bootstrap of the difference in tau
    on the prompts both measured (same resampled prompts for both), 95%."""
    if len(reports) < 2:
        return []
    boot = get_in(reports[0], "suites", "bootstrap") or {"samples": 1000, "seed": 0}
    base = scaling.requests_by_suite(reports[0])
    out = []
    for other in reports[1:]:
        for suite, rows in scaling.requests_by_suite(other).items():
            diff = paired_difference(base.get(suite, []), rows, boot["samples"], boot["seed"])
            if diff:
                out.append({"variant": other["variant"], "against": reports[0]["variant"], "suite": suite, **diff})
    return out


def comparison_sections(rows: list[dict[str, Any]], diffs: list[dict[str, Any]] | None = None,
                        curves: list[scaling.Curve] | None = None,
                        reports: list[dict[str, Any]] | None = None) -> list[Section]:
    def cell(row: dict, column: str) -> str:
        if column == "acceptance_rates_trained":
            rates = [row[c] for c in row if c.startswith("acceptance_rate_pos") and c.endswith("_trained")]
            return fmt(rates) if rates else "n/a"
        value = row.get(column)
        if column == "speedup_shown":
            return value
        return "(base config)" if column == "changed_settings" and not value else fmt(value)

    tables = [Table(list(SUMMARY_COLUMNS.values()), [[cell(r, c) for c in SUMMARY_COLUMNS] for r in rows])]
    categories = sorted({c[len(CATEGORY_PREFIX):] for r in rows for c in r if c.startswith(CATEGORY_PREFIX)})
    if categories:
        tables.append(Table(["variant", *categories],
                            [[r["variant"], *(fmt(r.get(CATEGORY_PREFIX + c)) for c in categories)] for r in rows]))
    suites = sorted({c[len(SUITE_PREFIX):] for r in rows for c in r
                     if c.startswith(SUITE_PREFIX) and c.count(":") == 1})
    if suites:
        def tau_cell(r: dict, s: str) -> str:
            low, high = r.get(f"{SUITE_PREFIX}{s}:interval_low"), r.get(f"{SUITE_PREFIX}{s}:interval_high")
            return fmt(r.get(SUITE_PREFIX + s)) + (f" [{low:.3f}, {high:.3f}]" if low is not None else "")

        def label(s: str) -> str:  # as the reports name it (MT-Bench for `eval`, ...)
            return next((r[f"{SUITE_PREFIX}{s}:label"] for r in rows if r.get(f"{SUITE_PREFIX}{s}:label")), s)

        tables.append(Table(["variant", *(f"{label(s)}: tau [95%]" for s in suites)],
                            [[r["variant"], *(tau_cell(r, s) for s in suites)] for r in rows]))
    if diffs:
        tables.append(Table(["variant", "against", "suite", "prompts", "tau difference", "95% interval (paired)",
                             "differs"],
                            [[d["variant"], d["against"], d["suite"], d["prompts"], fmt(d["difference"]),
                              fmt(d["interval"]), "YES" if d["differs"] else "no (within the interval)"]
                             for d in diffs]))
    return [Section(f"Draft variants compared ({len(rows)})", [
        "One row per variant: the settings it changes from the base config, its verification verdict, the mean "
        "acceptance length of its trained and untrained draft (1.0 = the draft never helps), the trained "
        "draft's acceptance rate per position, the selected epoch's validation loss, the speedup measured in "
        "interleaved rounds (with its 95% interval, or why it is not measured), and the "
        "directories of the traces, tokenized data and hidden states it is built from (shared where the "
        "settings are equal); then the trained draft's mean acceptance length per eval category, and per "
        "eval suite with its 95% bootstrap interval. Each variant is compared with the first by a paired "
        "bootstrap of the difference on the prompts both measured: it differs when the difference's 95% "
        "interval excludes 0. Every "
        "column for every variant is in comparison.csv; each variant's own report is in "
        "drafts/<variant>/report/."], tables, [PLOT]), *type_ranking.sections(reports or []),
        *scaling.sections(curves or [])]


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--reports", nargs="+", required=True, help="verification.json of each variant")
    p.add_argument("--out", required=True, help="comparison.csv to write")
    p.add_argument("--markdown", help="comparison.md to write")
    p.add_argument("--html", help="comparison.html to write")
    args = p.parse_args()
    rows = [variant_row(Path(r)) for r in args.reports]
    reports = [read_json(Path(r), "verification report") for r in args.reports]
    diffs = differences(reports)
    curves = scaling.scaling_curves(reports)
    for d in diffs:  # in the csv too: the difference from the first variant and whether it is beyond chance
        row = next(r for r in rows if r["variant"] == d["variant"])
        row[f"{SUITE_PREFIX}{d['suite']}:difference_vs_{d['against']}"] = d["difference"]
        row[f"{SUITE_PREFIX}{d['suite']}:differs_vs_{d['against']}"] = d["differs"]
    for curve in curves:  # the last step's gain, on the larger variant's row
        for d in curve.last_step:
            row = next(r for r in rows if r["variant"] == d["to"])
            row[f"{SUITE_PREFIX}{d['suite']}:gain_per_conversation_vs_{d['from']}"] = d["per_conversation"]
            row[f"{SUITE_PREFIX}{d['suite']}:gain_per_conversation_vs_{d['from']}:interval_low"], \
                row[f"{SUITE_PREFIX}{d['suite']}:gain_per_conversation_vs_{d['from']}:interval_high"] = \
                d["per_conversation_interval"]
    names = [r["variant"] for r in rows]
    if len(set(names)) != len(names):
        raise PipelineError(f"--reports: variant names repeat ({names}); give one report per variant")
    columns: list[str] = []
    for r in rows:  # union of columns in first-seen order (variants may differ in k)
        columns += [c for c in r if c not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(args.out, buf.getvalue())
    sections = comparison_sections(rows, diffs, curves, reports)
    if args.markdown:
        atomic_write_text(args.markdown, render_markdown(sections, Path(args.html or "comparison.html").name))
    if args.html:
        plots = {PLOT: acceptance_plot(rows)}
        if curves:
            plots[scaling.PLOT] = scaling.plot(curves)
        atomic_write_text(args.html, render_html("Draft variants compared", sections, plots))
    print(f"[compare] {len(rows)} variant(s) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
