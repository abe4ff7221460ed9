#!/usr/bin/env python
"""The benchmark table: per stage, the pipeline's tokens/s from its rules' own records
(Snakemake benchmark: files, shard summaries, train metrics, checkpoints), the limit measured in
the same run on the same rows (bench/limits.py), and the ratio. Prints it and writes
table.csv + table.json (with every underlying figure) into --out.

    python bench/summarize_benchmarks.py --short-run R1 --long-run R2 --limits L --out D [--train-run R3]"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

# The transformers traces backend before its static-cache decoding (2026-12-03), same short-row config, H200.
TRACES_BEFORE_TOK_S = 2018.0


def wall_s(paths) -> float:
    return sum(float(pd.read_csv(p, sep="\t")["s"].iloc[0]) for p in paths)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def traces_row(run: Path, limit: dict) -> dict:
    shards = [read(p) for p in sorted((run / "traces" / "shards").glob("*.summary.json"))]
    tokens = sum(s["new_completion_tokens"] for s in shards)
    gen_s = sum(s["generate_s"] for s in shards)
    warmup_s = sum(s.get("warmup_s") or 0.0 for s in shards)
    job_s = wall_s(sorted((run / "benchmarks" / "traces").glob("*.tsv")))
    steady = tokens / (gen_s - warmup_s)
    return {"stage": "traces (transformers), short rows", "pipeline_tok_s": steady,
            "limit_tok_s": limit["tokens_per_s"], "ratio": steady / limit["tokens_per_s"],
            "detail": {"tokens": tokens, "generate_s": gen_s, "warmup_s": warmup_s, "job_s": job_s,
                       "tok_s_incl_warmup": tokens / gen_s, "tok_s_incl_job_start": tokens / job_s,
                       "x_before_steady": steady / TRACES_BEFORE_TOK_S,
                       "x_before_incl_job_start": tokens / job_s / TRACES_BEFORE_TOK_S,
                       "decoding": [s.get("decoding") for s in shards], "batches": [s.get("batches") for s in shards],
                       "limit": limit}}


def hidden_states_row(run: Path, limits: dict) -> dict:
    shards = [read(p) for p in sorted((run / "hidden_states" / "shards").glob("*.json"))]
    tokens = sum(s["regenerated_tokens"] for s in shards)
    extract_s = sum(s["extract_s"] for s in shards)
    job_s = wall_s(sorted((run / "benchmarks" / "hidden_states").glob("*.tsv")))
    forward, disk = limits["forward"]["tokens_per_s"], limits["disk"]["tokens_per_s"]
    limit = min(forward, disk)
    rate = tokens / extract_s
    return {"stage": "hidden states (transformers), long rows", "pipeline_tok_s": rate, "limit_tok_s": limit,
            "ratio": rate / limit,
            "detail": {"tokens": tokens, "bytes": sum(s["bytes"] for s in shards), "extract_s": extract_s,
                       "startup_s": sum(s["startup_s"] for s in shards), "job_s": job_s,
                       "tok_s_incl_job_start": tokens / job_s, "forward_limit_tok_s": forward,
                       "disk_limit_tok_s": disk, "limit_is": "disk" if disk <= forward else "forward",
                       "limits": limits}}


def alone_step_profile(log: Path, steps_per_epoch: list[int]) -> list[dict]:
    """speculators-alone's per-step profile, per epoch, from its console log (its metric records,
    printed as `profile/step_ms=...` by speculators' own formatter)."""
    import re

    text = log.read_text()
    step_ms = [float(x) for x in re.findall(r"profile/step_ms=([0-9.e+-]+)", text)]
    tok_s = [float(x) for x in re.findall(r"profile/tokens_per_s=([0-9.e+-]+)", text)]
    if len(step_ms) != sum(steps_per_epoch) or len(tok_s) != len(step_ms):
        raise ValueError(f"{log}: {len(step_ms)} step records, expected {sum(steps_per_epoch)}")
    epochs, at = [], 0
    for n in steps_per_epoch:
        ms, tps = step_ms[at:at + n], tok_s[at:at + n]
        at += n
        step_s = sum(ms) / 1000
        tokens = sum(t * m / 1000 for t, m in zip(tps, ms))
        epochs.append({"steps": n, "step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
                       "first_step_s": ms[0] / 1000})
    return epochs


def train_rows(run: Path, limit: dict, variant: str = "default") -> list[dict]:
    metrics = pd.read_csv(run / "drafts" / variant / "train_metrics.csv")
    train = metrics[metrics["split"] == "train"]
    tokens = float(train["tokens"].sum())
    rule, alone = limit["rule"], limit["alone"]
    job_s = wall_s([run / "benchmarks" / "train" / f"{variant}.tsv"])
    rows = [{"stage": "training through the rule: speculators' start to last checkpoint",
             "pipeline_tok_s": tokens / rule["total_s"], "limit_tok_s": tokens / alone["total_s"],
             "ratio": alone["total_s"] / rule["total_s"],
             "detail": {"tokens": tokens, "rule_epoch_s": rule["epoch_s"], "alone_epoch_s": alone["epoch_s"],
                        "job_s": job_s, "tok_s_job_incl_checks_and_untrained": tokens / job_s,
                        "alone_process_wall_s": alone["process_wall_s"],
                        "epochs": train.to_dict(orient="records"), "limit": limit}}]
    steps = [int(n) for n in train["steps"]]
    alone_steps = alone_step_profile(run / "bench-speculators-alone.log", steps)
    rule_last = float(train["tokens_per_s"].iloc[-1])
    rows.append({"stage": "training, last epoch: speculators' per-step times", "pipeline_tok_s": rule_last,
                 "limit_tok_s": alone_steps[-1]["tokens_per_s"], "ratio": rule_last / alone_steps[-1]["tokens_per_s"],
                 "detail": {"alone_epochs": alone_steps}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short-run", required=True, type=Path)
    p.add_argument("--long-run", required=True, type=Path)
    p.add_argument("--train-run", type=Path, help="the long-row run whose training was measured (default: --long-run)")
    p.add_argument("--limits", required=True, type=Path, help="dir with bench/limits.py's traces/hidden_states/train.json")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    rows, problems = [], {}
    builders = [("traces", lambda: [traces_row(args.short_run, read(args.limits / "traces.json"))]),
                ("hidden_states", lambda: [hidden_states_row(args.long_run, read(args.limits / "hidden_states.json"))]),
                ("train", lambda: train_rows(args.train_run or args.long_run, read(args.limits / "train.json")))]
    for name, build in builders:
        try:  # one stage's missing record must not hide the others' figures
            rows.extend(build())
        except (OSError, KeyError, ValueError, IndexError) as err:
            problems[name] = f"{type(err).__name__}: {err}"
    table = pd.DataFrame([{k: r[k] for k in ("stage", "pipeline_tok_s", "limit_tok_s", "ratio")} for r in rows])
    args.out.mkdir(parents=True, exist_ok=True)
    table.round({"pipeline_tok_s": 0, "limit_tok_s": 0, "ratio": 3}).to_csv(args.out / "table.csv", index=False)
    (args.out / "table.json").write_text(json.dumps({"rows": rows, "problems": problems}, indent=2, default=str) + "\n")
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(table.round({"pipeline_tok_s": 0, "limit_tok_s": 0, "ratio": 3}).to_string(index=False))
    for r in rows:
        d = r["detail"]
        if "x_before_steady" in d:
            print(f"traces: {d['x_before_steady']:.1f}x the 2,018 tok/s before (steady), "
                  f"{d['tok_s_incl_warmup']:.0f} tok/s incl. {d['warmup_s']:.1f} s warm-up, "
                  f"{d['tok_s_incl_job_start']:.0f} tok/s incl. job start ({d['job_s']:.1f} s job)")
        if "forward_limit_tok_s" in d:
            print(f"hidden states: forward limit {d['forward_limit_tok_s']:.0f}, disk limit {d['disk_limit_tok_s']:.0f} "
                  f"tok/s; pipeline incl. job start {d['tok_s_incl_job_start']:.0f} tok/s")
        if "rule_epoch_s" in d:
            print(f"training: epoch seconds rule {d['rule_epoch_s']} vs speculators alone {d['alone_epoch_s']}; "
                  f"train job {d['job_s']:.1f} s")
    for name, why in problems.items():
        print(f"NOT MEASURED: {name}: {why}")
    print(f"wrote {args.out / 'table.csv'} and {args.out / 'table.json'}")


if __name__ == "__main__":
    main()
