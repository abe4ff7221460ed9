#!/usr/bin/env python
"""How close a CPU's trace, hidden-state and training stages run to its own matmul peak.

On a finished demo run (results/<run_name>/), each stage whose compute dtype follows the CPU's
bf16 support is timed on a slice of the run's own data, in the dtype the run resolved (or
--dtype), through the code the pipeline runs:
  - matmul: torch.mm on the demo target's MLP shape, all cores: this CPU's peak in that dtype;
  - traces: the pipeline's vLLM generation backend on the first --prompts prompts of the run's
    prompts/train.jsonl, each one's first user turn (the run's max_tokens and batch size), timed
    by bench/traces_speed.py's vLLM timing;
  - hidden states: scripts/extract_hidden_states.py (vLLM backend) on the first --rows rows of
    the run's tokenized data, into a temp store;
  - training: speculators' trainer with the draft's own recorded flags (provenance.json
    trainer_argv) for --steps steps, under torch's profiler: the share of matmuls and of
    attention.
Traces and hidden states are also given as GFLOP/s implied by the target's parameter count
(2 FLOP per weight and token: the decoder's weights for every prompt and hidden-state token, plus
the lm_head for every generated one; attention left out, so the figure is a lower bound) and as a
share of the matmul peak. A stage near the peak cannot get faster in that dtype without less
arithmetic. Each stage runs in its own process, one after another.

    python bench/cpu_stage_arithmetic.py --results results/smollm2-135m-demo --out table.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
STAGES = ("matmul", "traces", "hidden_states", "training")


def weights(target: Path) -> dict:
    """Parameter counts of the target: the decoder body (what every token passes through) and
    the lm_head (vocab x hidden, what a generated token adds)."""
    from safetensors import safe_open

    total = embed = 0
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
                embed += n if "embed_tokens" in name else 0
    cfg = json.loads((target / "config.json").read_text())
    return {"body": total - embed - (0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"]),
            "lm_head": cfg["vocab_size"] * cfg["hidden_size"], "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"]}


def stage_matmul(args, dtype: str) -> dict:
    import torch

    w = weights(args.results / "target" / "model")
    a = torch.randn(4096, w["hidden_size"], dtype=getattr(torch, dtype))
    b = torch.randn(w["hidden_size"], w["intermediate_size"], dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    n, rounds = 20, []
    for _ in range(5):  # the best of 5 rounds: the peak, not a round a neighbour slowed
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        rounds.append(2 * a.shape[0] * a.shape[1] * b.shape[1] * n / (time.perf_counter() - t0) / 1e9)
    return {"shape": [4096, w["hidden_size"], w["intermediate_size"]], "threads": torch.get_num_threads(),
            "gflop_s": round(max(rounds), 1), "rounds_gflop_s": [round(r, 1) for r in rounds]}


def stage_traces(args, dtype: str) -> dict:
    from types import SimpleNamespace

    from pipeline_lib import runtime
    from pipeline_lib.generation import PromptRequest
    from traces_speed import first_turns, time_vllm  # bench/, this script's directory

    runtime.setup()
    cfg = json.loads((args.results / "traces" / "provenance.json").read_text())["settings"]
    requests = [PromptRequest(f"p{i}", m)
                for i, m in enumerate(first_turns(args.results / "prompts" / "train.jsonl", args.prompts))]
    timed = time_vllm(SimpleNamespace(target=args.results / "target" / "model", dtype=dtype,
                                      max_tokens=cfg["max_tokens"], batch_size=cfg["batch_size"]),
                      requests, requests[:4])
    w = weights(args.results / "target" / "model")
    prompt, generated, seconds = timed["prompt_tokens"], timed["tokens"], timed["seconds"]
    flop = 2 * w["body"] * (prompt + generated) + 2 * w["lm_head"] * generated
    return {"prompts": len(requests), "max_tokens": cfg["max_tokens"], "batch_size": cfg["batch_size"],
            "prompt_tokens": prompt, "generated_tokens": generated, "seconds": round(seconds, 1),
            "tok_s": round(generated / seconds, 1), "gflop_s": round(flop / seconds / 1e9, 1)}


def stage_hidden_states(args, dtype: str) -> dict:
    from datasets import load_from_disk

    run = args.results
    hs = json.loads((run / "hidden_states" / "provenance.json").read_text())["settings"]
    rows = len(load_from_disk(str(run / "tokenized" / "data")))
    settings = {"backend": "vllm", "dtype": dtype, "storage": hs.get("storage", "bf16"),
                "aux_layer_ids": hs.get("aux_layer_ids")}
    with tempfile.TemporaryDirectory(prefix="hs-bench-") as tmp:
        # Shard 0 of n holds the first rows/n rows: as close to --rows as whole shards allow.
        shards = max(1, round(rows / args.rows))
        out = Path(tmp) / "shard.json"
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "extract_hidden_states.py"),
                               "--settings", json.dumps(settings), "--target", str(run / "target" / "model"),
                               "--manifest", str(run / "target" / "manifest.json"),
                               "--data", str(run / "tokenized" / "data"), "--shard", "0", "--num-shards", str(shards),
                               "--store-dir", str(Path(tmp) / "store"), "--out", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not out.exists():
            raise SystemExit(f"extract_hidden_states.py wrote no summary; its log ends with:\n{proc.stderr[-3000:]}")
        summary = json.loads(out.read_text())
    w = weights(run / "target" / "model")
    tokens, seconds = summary["regenerated_tokens"], summary["extract_s"]
    return {"rows": summary["rows"], "tokens": tokens, "seconds": seconds, "tok_s": summary["tokens_per_s"],
            "gflop_s": round(2 * w["body"] * tokens / seconds / 1e9, 1)}


def stage_training(args, dtype: str) -> dict:
    from pipeline_lib import runtime, speculators_cpu

    runtime.setup()
    speculators_cpu.apply()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig
    from torch.profiler import ProfilerActivity, profile

    argv = list(json.loads((args.results / "drafts" / args.draft / "provenance.json").read_text())["trainer_argv"])
    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        for flag, value in (("--save-path", f"{tmp}/ckpt"), ("--log-dir", f"{tmp}/logs"), ("--epochs", "1"),
                            ("--hidden-states-dtype", dtype)):
            argv[argv.index(flag) + 1] = value
        argv += ["--max-steps", str(args.steps)]
        config = TrainConfig.resolve(argv)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            main(config)
            seconds = time.perf_counter() - t0
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    share = lambda keys: round(sum(v for k, v in ops.items() if any(s in k for s in keys)) / total, 3)  # noqa: E731
    return {"steps": args.steps, "seconds": round(seconds, 1),
            "matmul_share": share(("aten::mm", "aten::addmm", "aten::bmm")),
            "attention_share": share(("scaled_dot_product",)),
            "note": "seconds include model set-up and one validation pass"}


def run_stage(stage: str, args) -> dict:
    """Each stage in a fresh process (vLLM engines and the trainer do not share one well)."""
    cmd = [sys.executable, __file__, "--results", str(args.results), "--draft", args.draft, "--rows", str(args.rows),
           "--prompts", str(args.prompts), "--steps", str(args.steps), "--stage", stage]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([*cmd, "--out", out.name], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"stage {stage} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def resolved_dtype(args) -> str:
    if args.dtype:
        return args.dtype
    prov = json.loads((args.results / "hidden_states" / "provenance.json").read_text())
    return prov["dtype_resolution"][0]["dtype"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "smollm2-135m-demo")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the one the run resolved)")
    ap.add_argument("--rows", type=int, default=128, help="hidden-state rows to extract")
    ap.add_argument("--prompts", type=int, default=128, help="prompts to answer")
    ap.add_argument("--steps", type=int, default=12, help="training steps")
    ap.add_argument("--stage", choices=STAGES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    needed = args.results / "drafts" / args.draft / "provenance.json"
    if not needed.exists():
        raise SystemExit(f"{needed} is missing: --results must be a finished run with the draft --draft "
                         f"{args.draft} (`make demo` makes {ROOT / 'results' / 'smollm2-135m-demo'})")
    dtype = resolved_dtype(args)
    if args.stage:
        result = globals()[f"stage_{args.stage}"](args, dtype)
        args.out.write_text(json.dumps(result))
        return
    from pipeline_lib import dtypes

    table = {"dtype": dtype, "cpu": dtypes.probe_cpu(), "cpu_count": os.cpu_count()}
    for stage in STAGES:
        table[stage] = run_stage(stage, args)
        print(stage, json.dumps(table[stage]), flush=True)
    peak = table["matmul"]["gflop_s"]
    for stage in ("traces", "hidden_states"):
        table[stage]["share_of_matmul_peak"] = round(table[stage]["gflop_s"] / peak, 2)
    from pipeline_lib.io import atomic_write_json

    atomic_write_json(args.out, table)
    print(f"\ndtype {dtype}, native bf16: {table['cpu']['native']} ({table['cpu']['basis']})\n| stage | rate | GFLOP/s (weights only) | of the matmul peak |\n|---|---|---|---|\n"
          f"| matmul {table['matmul']['shape']} | | {peak} | 1.00 |\n"
          f"| traces | {table['traces']['tok_s']} generated tok/s | {table['traces']['gflop_s']} | "
          f"{table['traces']['share_of_matmul_peak']} |\n"
          f"| hidden states | {table['hidden_states']['tok_s']} tok/s | {table['hidden_states']['gflop_s']} | "
          f"{table['hidden_states']['share_of_matmul_peak']} |\n"
          f"| training | {table['training']['steps']} steps in {table['training']['seconds']} s | matmul "
          f"{table['training']['matmul_share']:.0%} and attention {table['training']['attention_share']:.0%} "
          f"of the profiled time | |")


if __name__ == "__main__":
    main()
