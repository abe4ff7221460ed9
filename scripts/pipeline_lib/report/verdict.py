"""PASS or FAIL and why: the thresholds (verify.thresholds) and the verdict."""
from __future__ import annotations

from ..io import get_in
from ..render import Section, Table, fmt

# settings.thresholds key -> (what it is compared with, how to read that value from acceptance.json)
THRESHOLDS = {
    "min_mean_acceptance_length": ("mean acceptance length (trained draft)",
                                   lambda a: get_in(a, "acceptance", "trained", "mean_acceptance_length")),
    "min_acceptance_rate_pos0": ("acceptance rate at position 0 (trained draft)",
                                 lambda a: (get_in(a, "acceptance", "trained", "acceptance_rate_per_position") or [None])[0]),
    "min_speedup": ("speedup: output tokens/s with / without the draft, at concurrency 1 (else at the batch)",
                    lambda a: get_in(a, "throughput", "speedup")),
}

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
    if get_in(acceptance, "consistency") and any(v.get("matches") is False for v in acceptance["consistency"].values()):
        warnings.append("vLLM's global spec-decode counters and the per-request metrics disagree")
    if chain is not None and not chain["intact"]:
        named = sorted({c["path"] for c in chain["changed_on_disk"]} | {b["path"] for b in chain["broken"]})
        warnings.append(f"provenance chain broken: {', '.join(named)} no longer match(es) the recorded digests "
                        f"(changed after the run?); see Provenance chain")
    return {"passed": not reasons, "reasons": reasons, "warnings": warnings}


def sections(result: dict) -> list[Section]:
    return [Section("Thresholds", [], [Table(
        ["threshold", "measures", "limit", "value", "status"],
        [[t["name"], t["measures"], fmt(t["threshold"]), fmt(t["value"]), t["status"]] for t in result["thresholds"]])])]
