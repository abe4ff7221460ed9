"""The contract checks (check_contract.py's contract.json) and the reference draft side by side."""
from __future__ import annotations

from ..render import Section, Table, fmt

def sections(result: dict) -> list[Section]:
    contract = result["contract"]
    out = [Section(
        f"Contract checks — {'PASS' if contract.get('passed') else 'FAIL'}",
        [f"{fmt(contract.get('summary'))}. Not run (—) means an earlier check it depends on failed, or "
         f"(informational checks) what it needs is missing here: its line says which."],
        [Table(["check", "status", "expected", "seen", "detail"],
               [[c["name"] + ("" if c.get("required", True) else " (informational)"),
                 {True: "PASS", False: "FAIL", None: "—"}[c["passed"]], fmt(c["expected"]), fmt(c["seen"]),
                 c["detail"] or ""] for c in contract.get("checks", [])])])]
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
        out.append(Section("Reference draft, side by side", text, tables))
    return out
