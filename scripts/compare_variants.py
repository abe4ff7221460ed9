#!/usr/bin/env python
"""One CSV row per draft variant, from each variant's report/verification.json: verdict,
contract result, mean acceptance length (trained and untrained), per-position acceptance
rates, speedup, and the selected epoch's validation loss and per-position accuracies.

    python scripts/compare_variants.py --reports R/drafts/*/report/verification.json \\
        --out R/drafts/comparison.csv
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


def variant_row(path: Path) -> dict[str, Any]:
    v = read_json(path, "verification report")
    if "variant" not in v or "verdict" not in v:
        raise PipelineError(f"{path}: not a verification.json written by make_report.py (no variant/verdict)")
    acc = v.get("acceptance") or {}
    row: dict[str, Any] = {
        "variant": v["variant"],
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
    row["speedup"] = get_in(acc, "throughput", "speedup")
    row["speedup_measured_at"] = get_in(acc, "throughput", "speedup_measured_at")
    row["speedup_batch"] = get_in(acc, "throughput", "batch", "speedup")
    row["speedup_concurrency_1"] = get_in(acc, "throughput", "concurrency_1", "speedup")
    training = v.get("training") or {}
    row["selected_epoch"] = training.get("selected_epoch")
    for key, value in (training.get("selected_val") or {}).items():
        row[f"val_{key}"] = value
    row["thresholds_failed"] = ";".join(t["name"] for t in v.get("thresholds", []) if t.get("status") == "FAIL")
    return row


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--reports", nargs="+", required=True, help="verification.json of each variant")
    p.add_argument("--out", required=True, help="comparison.csv to write")
    args = p.parse_args()
    rows = [variant_row(Path(r)) for r in args.reports]
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
    print(f"[compare] {len(rows)} variant(s) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
