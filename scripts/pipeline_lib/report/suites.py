"""Eval suites: tau per suite with its bootstrap interval, per category, degenerate answers and
overlap with the training prompts; each suite named as a user knows it."""
from __future__ import annotations

from typing import Any

from ..render import Section, Table, fmt
from ..suite_stats import BASE_SUITE, HELD_OUT_SUITE, suite_figures

# The name a user knows a benchmark by, for the eval-set formats that are one benchmark.
SOURCE_NAMES = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "champ": "CHAMP"}


def source_name(source: dict | None) -> str | None:
    """A prompt source's own name: the benchmark its format reads, else the dataset, package
    or file it comes from (pypi:PKG/..., a hub id ORG/NAME, a local file's name)."""
    if not source or not source.get("source"):
        return None
    if source.get("format") in SOURCE_NAMES:
        return SOURCE_NAMES[source["format"]]
    where = str(source["source"])
    if where.startswith("pypi:"):
        return where[len("pypi:"):].split("/")[0]
    return where.rstrip("/").split("/")[-1].split(".")[0] or where


def suite_labels(names: list[str], settings: dict, eval_source: dict | None, eval_name: str | None,
                 eval_held_out: bool = False) -> dict[str, str]:
    """suite name -> how the report names it: the base suite (prompts.eval) by
    verify.eval_name, else by its source (MT-Bench for the mtbench format); a verify.suites
    entry by its config name, with its source's name where that says more; the held-out
    training prompts as such."""
    entries = {e["name"]: e for e in settings.get("suites") or []}
    out = {}
    for name in names:
        if name == BASE_SUITE:
            out[name] = eval_name or source_name(eval_source) or (
                "held out of the training sources" if eval_held_out else name)
        elif name == HELD_OUT_SUITE:
            out[name] = "held out of the training mix"
        else:
            own = source_name(entries.get(name))
            out[name] = (own if own and own.lower() == name.lower() else f"{name} ({own})" if own else name)
    return out


def suites_summary(acc: dict, overlaps: list[dict], settings: dict, eval_held_out: bool = False,
                   eval_source: dict | None = None) -> dict[str, Any] | None:
    """Per suite (prompts/eval.jsonl is `eval`): tau with its bootstrap interval, per category,
    degenerate answers and tau without them, for the trained and untrained drafts; the suite's
    overlap with the training prompts, marked over verify.overlap_threshold; the name each is
    shown by (suite_labels). eval_held_out: the `eval` suite was split off the training sources
    (prompts.eval.source null), not decontaminated; eval_source: prompts.eval as prompts_eval read it."""
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
            "overlap_threshold": threshold, "overlap": by_suite, "eval_held_out": eval_held_out,
            "labels": suite_labels(list(out["trained"]["figures"]), settings, eval_source, settings.get("eval_name"),
                                   eval_held_out),
            **out}


def sections(result: dict) -> list[Section]:
    suites = result.get("suites")
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
        rows.append([suites["labels"].get(name, name), s["prompts"], fmt(s["mean_acceptance_length"]), fmt(s["interval"]),
                     fmt(u.get("mean_acceptance_length")), s["degenerate"]["count"],
                     fmt(s["without_degenerate"]["mean_acceptance_length"]), overlap])
        cat_rows += [[suites["labels"].get(name, name), c, v["prompts"], fmt(v["mean_acceptance_length"]), fmt(v["interval"])]
                     for c, v in s["per_category"].items()]
        degenerate_rows += [[suites["labels"].get(name, name), d["id"], d["kind"], d.get("period", ""), d.get("repeats", ""),
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
            text.append(f"Overlap examples of {suites['labels'].get(name, name)}: " + "; ".join(
                f"{e['id']} ({e['ngram']!r})" for e in o["examples"][:5]) + ".")
    tables = [Table(["suite", "prompts", "tau", "95% interval", "untrained tau", "degenerate", "tau without them",
                     "overlap with training prompts"], rows),
              Table(["suite", "category", "prompts", "tau", "95% interval"], cat_rows)]
    if degenerate_rows:
        tables.append(Table(["suite", "prompt", "kind", "period", "repeats", "loop (decoded)"], degenerate_rows))
    else:
        text.append("No degenerate answers.")
    return [Section("Eval suites", text, tables, ["Acceptance length per suite and category (95% intervals)"])]
