"""Acceptance in the backend (trained vs untrained draft): the numbers, greedy equality with and
without speculation, per category, reasoning vs answer spans."""
from __future__ import annotations

from ..io import get_in
from ..render import Section, Table, fmt

def sections(result: dict) -> list[Section]:
    acc = result["acceptance"]
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
