#!/usr/bin/env python
"""Throughput of the heavy stages from a finished run's own records: Snakemake's benchmark:
files (wall seconds per job) and the artifacts' token counts.

    python bench/summarize_benchmarks.py results/<run_name>"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


def wall_s(paths) -> float:
    return sum(float(pd.read_csv(p, sep="\t")["s"].iloc[0]) for p in paths)


def main(run_dir: str) -> None:
    r = Path(run_dir)
    out = {}
    traces = json.loads((r / "traces/summary.json").read_text())
    s = wall_s(sorted((r / "benchmarks/traces").glob("*.tsv")))
    out["traces"] = {"completion_tokens": traces["completion_tokens"], "wall_s": round(s, 1),
                     "tokens_per_s": round(traces["completion_tokens"] / s, 1)}
    hs = json.loads((r / "hidden_states/manifest.json").read_text())
    shard_files = sorted((r / "benchmarks/hidden_states").glob("*.tsv"))
    s = wall_s(shard_files)
    shards = [json.loads(p.read_text()) for p in sorted((r / "hidden_states/shards").glob("*.json"))]
    out["hidden_states"] = {"tokens": hs["tokens"], "bytes": hs["bytes"], "bytes_per_token": hs["bytes_per_token"],
                            "jobs_wall_s": round(s, 1), "tokens_per_s_incl_startup": round(hs["tokens"] / s, 1),
                            "tokens_per_s_extraction": [sh.get("tokens_per_s") for sh in shards]}
    for bench in sorted((r / "benchmarks/train").glob("*.tsv")):
        variant = bench.stem
        metrics = pd.read_csv(r / f"drafts/{variant}/train_metrics.csv")
        train_rows = metrics[metrics["split"] == "train"]
        out[f"train/{variant}"] = {"job_wall_s": round(wall_s([bench]), 1),
                                   "steps_per_s": train_rows.get("steps_per_s", pd.Series(dtype=float)).round(2).tolist(),
                                   "tokens_per_s": train_rows.get("tokens_per_s", pd.Series(dtype=float)).round(0).tolist()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
