#!/usr/bin/env python
"""Verify a finished results tree against its provenance: every input and output digest
recorded in every provenance.json must still match what is on disk.

    python scripts/check_provenance.py results/smollm2-135m-demo
Exit 0 when everything matches; 1 with one line per mismatch naming the artifact."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import read_json  # noqa: E402
from pipeline_lib.provenance import DiskDigests, recorded_base  # noqa: E402


def check_tree(root: Path) -> tuple[int, list[str]]:
    files = sorted(root.rglob("provenance.json")) + sorted(root.rglob("*.provenance.json"))
    if not files:
        raise PipelineError(f"{root}: no provenance.json found; is this a results/<run_name> dir?")
    disk = DiskDigests(recorded_base(root))
    checked, problems = 0, []
    for prov_path in files:
        prov = read_json(prov_path, "provenance")
        artifact = prov_path.parent.relative_to(root) if prov_path.name == "provenance.json" else prov_path.relative_to(root)
        for kind in ("inputs", "outputs"):
            for name, entry in (prov.get(kind) or {}).items():
                checked += 1
                status = disk.status(entry["path"], entry["digest"])
                path = disk.resolve(entry["path"])
                if status == "missing":
                    problems.append(f"{artifact} ({prov['rule']}): {kind[:-1]} '{name}' missing: {path}")
                elif status == "changed":
                    problems.append(f"{artifact} ({prov['rule']}): {kind[:-1]} '{name}' changed since it was "
                                    f"recorded: {path} (recorded {entry['digest'][:19]}..., now "
                                    f"{disk.current(entry['path'])[:19]}...)")
    return checked, problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a results/<run_name> directory")
    args = p.parse_args()
    checked, problems = check_tree(args.results)
    for line in problems:
        print(f"MISMATCH {line}")
    print(f"{checked} recorded digests checked, {len(problems)} mismatches")
    return 1 if problems else 0


if __name__ == "__main__":
    run_main(main)
