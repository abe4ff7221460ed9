"""Throughput and the speedup: output tokens/s with and without the draft, measured in
interleaved rounds inside the acceptance job (pipeline_lib.acceptance.speedup), the ratio with
its 95% interval, or "not measured" with the reason."""
from __future__ import annotations

from ..render import Section, Table, fmt

SETTING_LABELS = {"concurrency_1": "concurrency 1", "batch": "batch"}


def speedup_text(entry: dict | None) -> str:
    """One setting's speedup as a reader sees it: '1.12 (95%: 0.98-1.26)' or 'not measured (why)'."""
    if not entry:
        return "not measured (no rounds ran)"
    if entry.get("speedup") is None:
        return f"not measured ({entry.get('reason') or 'no reason recorded'})"
    lo, hi = entry["interval"]
    return f"{entry['speedup']:.2f} (95%: {lo:.2f}-{hi:.2f})"


def sections(result: dict) -> list[Section]:
    acc = result["acceptance"]
    if acc.get("status") != "ok":
        return []
    t = acc.get("throughput") or {}
    rows = []
    for key, label in SETTING_LABELS.items():
        g = t.get(key)
        if g:
            rows.append([label, g["prompts"], len(g["rounds"]), fmt(g["without_draft"]["tokens_per_s"], 1),
                         fmt(g["with_draft"]["tokens_per_s"], 1), fmt(g["ratios"], 2), fmt(g["tau_bound"], 2),
                         speedup_text(g)])
    text = [f"Output tokens/s with and without the trained draft, measured in this job: {t.get('method')}. "
            f"Prompts: the first eval prompts, all at once (batch) or one at a time (concurrency 1), the same in "
            f"every round. A speedup above the draft's mean acceptance length on those prompts (tau, the bound) or "
            f"rounds whose ratios differ by more than verify.speedup_tolerance is reported as not measured."]
    return [Section("Throughput and speedup", text,
                    [Table(["setting", "prompts", "rounds", "tokens/s without draft", "tokens/s with draft",
                            "ratio per round", "tau (bound)", "speedup"], rows)] if rows else [],
                    ["Throughput with and without the draft"])]
