#!/usr/bin/env python
"""Tensor parallel 2 against tensor parallel 1 on the CPU, for the load check and the acceptance
job (baseline, drafts, speedup rounds), on the tests' tiny target and a draft the pipeline trains
for it. vLLM's CPU backend runs tensor parallel across processes (pipeline_lib/parallel.py,
PIPELINE_CPU_TENSOR_PARALLEL). The noise is measured, not assumed: tensor parallel 1 runs twice.

    .venv/bin/python bench/tensor_parallel_cpu.py [--work DIR] [--out bench/results/tensor-parallel-cpu-DATE.json]

Writes per layout and repeat: the load check's greedy token ids, drafts and tau; the acceptance
job's greedy token ids without and with the draft, tau trained and untrained, its speedup
engines' layout; and the comparison (tokens equal, tau differences against the TP1 repeats')."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))
from conftest import base_test_config, build_target, run_snakemake  # noqa: E402

PY = sys.executable
SETTINGS = {"backend": "vllm", "num_speculative_tokens": 3, "num_prompts": 8, "max_tokens": 32, "dtype": "float32",
            "concurrency_one_prompts": 2, "untrained_prompts": 4, "trust_remote_code": False,
            "speedup_rounds": 2, "speedup_batch_prompts": 8, "speedup_tolerance": 0.25, "speedup_engines": "auto"}
LAYOUTS = [("tp1-a", 1), ("tp1-b", 1), ("tp2", 2)]


def script(name: str, *args, env: dict, log: Path) -> float:
    t0 = time.time()
    with open(log, "w") as f:
        subprocess.run([PY, str(REPO / "scripts" / name), *map(str, args)], check=True, stdout=f,
                       stderr=subprocess.STDOUT, env=env)
    return round(time.time() - t0, 1)


def measure(r: Path, out: Path, tp: int, reuse: bool = False) -> dict:
    if reuse:
        return read_layout(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIPELINE_CPU_TENSOR_PARALLEL": str(tp)}
    settings = json.dumps(SETTINGS)
    seconds = {"load_check": script("load_check.py", "--target", r / "target/model", "--draft",
                                    r / "drafts/default/final", "--out", out / "load_check.json",
                                    env=env, log=out / "load_check.log")}
    seconds["baseline"] = script("measure_baseline.py", "--settings", settings, "--target", r / "target/model",
                                 "--prompts", r / "prompts/eval.jsonl", "--out", out / "baseline.json",
                                 env=env, log=out / "baseline.log")
    seconds["acceptance"] = script("measure_acceptance.py", "--settings", settings, "--target", r / "target/model",
                                   "--draft", r / "drafts/default/final", "--untrained", r / "drafts/default/untrained",
                                   "--prompts", r / "prompts/eval.jsonl", "--baseline", out / "baseline.json",
                                   "--out", out / "acceptance.json", env=env, log=out / "acceptance.log")
    (out / "seconds.json").write_text(json.dumps(seconds))
    return read_layout(out)


def read_layout(out: Path) -> dict:
    seconds = json.loads((out / "seconds.json").read_text())
    load = json.loads((out / "load_check.json").read_text())
    acc = json.loads((out / "acceptance.json").read_text())
    prov = json.loads((out / "acceptance.provenance.json").read_text())
    return {
        "seconds": seconds,
        "load_check": {"ok": load["ok"], "token_ids": load["token_ids"], "parallel": load["parallel"],
                       "tau": load["spec_decode"].get("mean_acceptance_length"),
                       "num_drafts": load["spec_decode"].get("num_drafts")},
        "acceptance": {
            "tau": {run: acc["acceptance"][run]["mean_acceptance_length"] for run in ("trained", "untrained")},
            # the target alone (baseline job) and, per trained-draft request, its verify steps
            "token_ids": [rec["token_ids"] for rec in json.loads((out / "baseline.json").read_text())["no_draft"]["records"]],
            "steps_accepted": [req["steps_accepted"] for req in acc["requests"]["trained"]],
            "greedy_equal_with_without_draft": acc.get("greedy_equality"),
            "speedup": acc["throughput"].get("speedup"), "speedup_not_measured": acc["throughput"].get("speedup_not_measured"),
            "speedup_engines": acc["timing"].get("speedup_engines"),
            "parallel": prov.get("parallel")},
    }


def load_check_flips(r: Path, runs: dict) -> list[dict]:
    """Where the load check's greedy tokens at tensor parallel 2 differ from 1: the target's
    top-2 logit gap at the first differing position, in float32 and in its own bfloat16
    (transformers). A gap below one bfloat16 step of the logits is a near-tie that any change of
    summation order may flip."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO / "scripts"))
    from load_check import PROMPTS

    target = r / "target/model"
    tok = AutoTokenizer.from_pretrained(target)
    flips = []
    for prompt, tp1, tp2 in zip(PROMPTS, runs["tp1-a"]["load_check"]["token_ids"], runs["tp2"]["load_check"]["token_ids"]):
        at = next((i for i, (x, y) in enumerate(zip(tp1, tp2)) if x != y), None)
        if at is None:
            continue
        ids = tok(prompt)["input_ids"] + tp1[:at]
        gaps = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            gaps[str(dtype).removeprefix("torch.")] = {
                "tp1_token_minus_tp2_token": round(float(logits[tp1[at]] - logits[tp2[at]]), 5),
                "argmax": int(logits.argmax()), "max_abs_logit": round(float(logits.abs().max()), 4)}
        flips.append({"prompt": prompt, "position": at, "tp1_token": tp1[at], "tp2_token": tp2[at],
                      "tokens_equal_after": tp1[at + 1:] == tp2[at + 1:], "logit_gap": gaps,
                      "bfloat16_step_at_this_magnitude": 2.0 ** -8})
    return flips


def compare(runs: dict) -> dict:
    a, b, tp2 = runs["tp1-a"], runs["tp1-b"], runs["tp2"]

    def taus(run):
        return {"load_check": run["load_check"]["tau"], **{f"acceptance_{k}": v for k, v in run["acceptance"]["tau"].items()}}

    noise = {k: abs(taus(a)[k] - taus(b)[k]) for k in taus(a)}
    diff = {k: abs(taus(tp2)[k] - taus(a)[k]) for k in taus(a)}
    return {"tp1_repeat_tau_difference": noise, "tp2_vs_tp1_tau_difference": diff,
            "load_check_tokens_equal": {"tp1_repeat": a["load_check"]["token_ids"] == b["load_check"]["token_ids"],
                                        "tp2_vs_tp1": tp2["load_check"]["token_ids"] == a["load_check"]["token_ids"]},
            "acceptance_tokens_equal": {"tp1_repeat": a["acceptance"]["token_ids"] == b["acceptance"]["token_ids"],
                                        "tp2_vs_tp1": tp2["acceptance"]["token_ids"] == a["acceptance"]["token_ids"]},
            "acceptance_steps_equal": {"tp1_repeat": a["acceptance"]["steps_accepted"] == b["acceptance"]["steps_accepted"],
                                       "tp2_vs_tp1": tp2["acceptance"]["steps_accepted"] == a["acceptance"]["steps_accepted"]},
            "tp2_within_noise": all(diff[k] <= noise[k] for k in diff)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/tp-cpu-bench"))
    p.add_argument("--reuse", action="store_true", help="the runs already in --work (no pipeline, no engines)")
    p.add_argument("--out", type=Path, default=REPO / "bench/results" / f"tensor-parallel-cpu-{time.strftime('%Y-%m-%d')}.json")
    args = p.parse_args()
    config = base_test_config(build_target("tiny"))
    config["generation"]["num_shards"] = config["hidden_states"]["num_shards"] = 1
    r = args.work / "results" / "tiny"
    rel = "results/tiny"
    if not args.reuse:
        run_snakemake(args.work, config, f"{rel}/drafts/default/final", f"{rel}/drafts/default/untrained",
                      f"{rel}/prompts/eval.jsonl", timeout=3600)
    runs = {name: measure(r, args.work / "layouts" / name, tp, reuse=args.reuse) for name, tp in LAYOUTS}
    record = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpus": os.cpu_count(), "processor": _cpu_model()},
              "settings": SETTINGS, "load_check_dtype": "the target's own (bfloat16)", "runs": runs,
              "comparison": {**compare(runs), "load_check_flips": load_check_flips(r, runs)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["comparison"], indent=1))
    return 0


def _cpu_model() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    sys.exit(main())
