"""What a user reads first: the verdict and ONE table (tau per suite with its 95% interval, the
speedup with its interval or why it is not measured, PASS/FAIL), then how to read the rest."""
from __future__ import annotations

from ..io import get_in
from ..render import Section, Table, fmt
from .throughput import SETTING_LABELS, speedup_text

HOW_TO_READ = """\
A draft model proposes `k` tokens; the target checks them in
one forward pass and keeps the longest prefix that equals its own greedy choice, plus one token
of its own. The **mean acceptance length** (tau) is the number of tokens emitted per target
forward: 1.0 means the draft never helps, k+1 is the ceiling. The **per-position acceptance
rate** is the fraction of drafts whose i-th token was accepted (a later position can only be
accepted after the earlier ones). The **untrained draft** (same architecture, random weights)
is the baseline: a trained draft must beat it clearly. **Throughput** compares output tokens/s
with and without the draft in interleaved rounds of the same job, all prompts of a round at
once (batch) and one at a time (concurrency 1); speculation pays at low concurrency on
memory-bound hardware and can cost throughput at large batches, especially on CPU; tau bounds
the speedup. **Greedy equality**: in float32 speculative decoding must not
change greedy outputs; a mismatch points at a numerical or engine problem. The **contract
checks** verify the checkpoint is what vLLM's speculators loader expects and that it matches
its target and training data (a failure there fails the build, because such drafts fail
silently: e.g. random embeddings or wrong aux layer ids give acceptance near 1.0). Thresholds
come from `verify.thresholds`; with `verify.fail_below_threshold: true` a missed one fails the
build. Every number shown is in verification.json.
"""


def summary_rows(result: dict) -> list[list[str]]:
    """[figure, value, 95% interval, status] rows: tau overall and per suite, the speedups."""
    acc, checks = result["acceptance"], {t["name"]: t for t in result["thresholds"]}
    if acc.get("status") != "ok":
        return [["acceptance", "not measured", "", f"FAIL ({acc.get('error_run')}: {acc.get('error')})"]]

    def status(name: str) -> str:
        t = checks.get(name)
        return "" if not t or t["status"] == "NOT SET" else f"{t['status']} (>= {fmt(t['threshold'], 2)})"

    trained = acc["acceptance"]["trained"]
    rows = [[f"mean acceptance length (tau), all {trained.get('prompts', acc['num_prompts'])} prompts",
             fmt(trained["mean_acceptance_length"], 2), "", status("min_mean_acceptance_length")]]
    suites = result.get("suites") or {}
    for name, s in (get_in(suites, "trained", "figures") or {}).items():
        lo_hi = s["interval"]
        rows.append([f"tau, {suites['labels'].get(name, name)} ({s['prompts']} prompts)",
                     fmt(s["mean_acceptance_length"], 2), f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}" if lo_hi else "n/a", ""])
    t = acc.get("throughput") or {}
    if not any(t.get(key) for key in SETTING_LABELS):  # no rounds ran (e.g. an engine did not start)
        rows.append(["speedup", "not measured", f"({t.get('speedup_not_measured') or 'no rounds ran'})", ""])
    for key, label in SETTING_LABELS.items():
        g = t.get(key)
        if not g:
            continue
        value = "not measured" if g["speedup"] is None else f"{g['speedup']:.2f}"
        interval = (f"{g['interval'][0]:.2f}-{g['interval'][1]:.2f}" if g["speedup"] is not None
                    else speedup_text(g)[len("not measured "):])
        rows.append([f"speedup at {label} ({g['prompts']} prompts x {len(g['rounds'])} rounds)", value, interval,
                     status("min_speedup") if key == t.get("speedup_measured_at") else ""])
    return rows


def sections(result: dict) -> list[Section]:
    v, variant = result["verdict"], result["variant"]
    head = Section(f"Draft verification: {variant} — {'PASS' if v['passed'] else 'FAIL'}",
                   [f"- FAIL: {r}" for r in v["reasons"]] + [f"- warning: {w}" for w in v["warnings"]],
                   [Table(["figure", "value", "95% interval", "status"],
                          summary_rows(result) + [["verdict", "PASS" if v["passed"] else "FAIL", "", ""]])])
    return [head, Section("How to read this report", [HOW_TO_READ])]
