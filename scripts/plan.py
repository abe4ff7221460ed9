#!/usr/bin/env python
"""Print and write the run's plan: jobs per rule with their resources, and estimates of
tokens, hidden-state bytes, checkpoint bytes and GPU-hours, before any heavy job runs.

    python scripts/plan.py --config-json '{...validated config...}' --results results/demo --out plan.json
(the `plan` rule passes the validated config; `snakemake -n` prints the same plan)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli  # noqa: E402
from pipeline_lib.errors import run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json  # noqa: E402
from pipeline_lib.plan import format_plan, make_plan  # noqa: E402


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--results", required=True, help="results/<run_name> dir")
    p.add_argument("--out", help="write the plan as JSON here")
    args = p.parse_args()
    plan = make_plan(args.settings, args.results)
    print(format_plan(plan))
    if args.out:
        atomic_write_json(args.out, plan)


if __name__ == "__main__":
    run_main(main)
