#!/usr/bin/env python
"""The speedup a draft buys, as a curve: output tokens/s (throughput) and tokens/s per user
(interactivity) with the trained draft and without it, at 1, 2, 4, ... requests in flight, in
`vllm serve`, measured with GuideLLM the way speculators' throughput-vs-interactivity tutorial
does: closed-loop streaming chat requests (`--profile kind=concurrent`), a warm-up and a
cool-down cut from each window, one GuideLLM run per point so that the server's own
speculative-decoding counters (`/metrics`) give the acceptance length of exactly that point.

Each point is checked before it is reported (a benchmark that lies is the failure this guards):
no failed requests, at least `--min-requests` completed in the window, the per-user gain at one
request in flight at most the acceptance length the server counted at that point (a draft
cannot make a step produce more tokens than it accepts), and the same prompts and max_tokens in
both arms. A point that fails a check is kept in the JSON with its reason and left out of the
table and the chart.

    python bench/speedup_curve.py --run results/R --variant default --out bench/.work/speedup
    BENCH_SMOKE=1 python bench/speedup_curve.py --out /tmp/speedup   # CPU: tiny target, random draft
Writes <out>/speedup_curve.json, speedup_curve.md (the table) and speedup_curve.png (the chart);
GuideLLM's own JSON per point under <out>/guidellm/. Needs GuideLLM (envs/gpu-node.txt pins it;
on a CPU machine `pip install --target DIR guidellm==0.8.1 click~=8.4.0` and PYTHONPATH=DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
# The server and the load are the forecast stage's own (pipeline_lib/forecast/): a forecast and a
# trained draft's curve are measured alike.
from pipeline_lib.forecast.load import check_point, guidellm_point, point_figures, prompts_file  # noqa: E402,F401
from pipeline_lib.forecast.server import Server, scrape  # noqa: E402,F401
from pipeline_lib.io import atomic_write_json, atomic_write_text  # noqa: E402
from pipeline_lib.runtime import setup  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
def gain_at_one(points: list[dict], streams: int) -> dict | None:
    """The per-user gain at the lowest concurrency and its ratio to the acceptance length counted
    there. A gain above tau (5% margin) is impossible for a draft (each verify step emits at most
    the accepted tokens plus one): the draft point is then marked not measured, with the reason."""
    one = {p["arm"]: p for p in points if p["streams"] == streams and not p.get("not_measured")}
    if len(one) < 2 or not one["draft"].get("tau"):
        return None
    gain, tau = one["draft"]["tok_s_per_user"] / one["no draft"]["tok_s_per_user"], one["draft"]["tau"]
    if gain > tau * 1.05:
        one["draft"]["not_measured"] = (f"per-user gain {gain:.2f} above the acceptance length {tau:.2f}: "
                                        f"the arms did not run alike")
    return {"streams": streams, "gain": gain, "tau": tau, "gain_over_tau": gain / tau}


def smoke_inputs(tmp: Path) -> dict:
    import acceptance_speed

    paths = acceptance_speed.smoke_inputs(tmp)
    return {"target": paths["target"], "draft": paths["draft"], "prompts": paths["prompts"], "dtype": "float32"}


def run_inputs(run: Path, variant: str) -> dict:
    # prompts/eval.jsonl: the run's main eval set (MT-Bench's 80 questions in the shipped configs)
    paths = {"target": run / "target/model", "draft": run / f"drafts/{variant}/final", "prompts": run / "prompts/eval.jsonl"}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: point --run at a finished run (results/<run_name>)")
    return {**paths, "dtype": "bfloat16"}


def first_turns(prompts: Path, category_prefix: str | None) -> list[str]:
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    if category_prefix:
        rows = [r for r in rows if str(r.get("id", "")).startswith(category_prefix)] or rows
    return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]


def table(points: list[dict], streams: list[int]) -> str:
    by = {(p["arm"], p["streams"]): p for p in points}
    lines = ["| requests in flight | output tok/s, no draft | with draft | ratio | tok/s per user, no draft "
             "| with draft | ratio | tau at the point | gain per user / tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in streams:
        a, b = by.get(("no draft", n)), by.get(("draft", n))
        if not a or not b or a.get("not_measured") or b.get("not_measured"):
            why = (a or {}).get("not_measured") or (b or {}).get("not_measured") or "not run"
            lines.append(f"| {n} | not measured: {why} |||||||| ")
            continue
        thr, user = b["output_tok_s"] / a["output_tok_s"], b["tok_s_per_user"] / a["tok_s_per_user"]
        tau = b["tau"]
        lines.append(f"| {n} | {a['output_tok_s']:,.0f} | {b['output_tok_s']:,.0f} | {thr:.2f} | "
                     f"{a['tok_s_per_user']:,.1f} | {b['tok_s_per_user']:,.1f} | {user:.2f} | "
                     f"{tau:.2f} | {user / tau:.2f} |" if tau else f"| {n} | ... | tau not counted |")
    return "\n".join(lines) + "\n"


def chart(points: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for arm, style in (("no draft", "o--"), ("draft", "s-")):
        pts = sorted((p for p in points if p["arm"] == arm and not p.get("not_measured")), key=lambda p: p["streams"])
        ax.plot([p["tok_s_per_user"] for p in pts], [p["output_tok_s"] for p in pts], style,
                label="EAGLE-3 draft" if arm == "draft" else "no draft")
        for p in pts:
            ax.annotate(str(p["streams"]), (p["tok_s_per_user"], p["output_tok_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("tokens/s per user (1000 / mean inter-token latency)")
    ax.set_ylabel("output tokens/s (server)")
    ax.set_yscale("log")
    ax.set_title("throughput vs interactivity; labels: requests in flight")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="a finished run: results/<run_name>")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--suite", default="mtbench", help="the eval prompts whose id starts with <suite>: (MT-Bench)")
    ap.add_argument("--streams", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--seconds", type=float, default=None, help="window per point (default 12; smoke 10)")
    ap.add_argument("--warmup", type=float, default=0.1,
                    help="fraction of each window cut at its start and at its end (GuideLLM reads values >= 1 as seconds)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per answer (default 128; smoke 32)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--min-requests", type=int, default=None, help="fewer completed requests: not measured (default 8; smoke 2)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # SIGTERM (a cancelled job, bench/gpu_vllm_offline.sh stopping an earlier run) unwinds, so
    # the `with Server` block stops the server's process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    setup()  # offline, and the pipeline's vLLM-on-CPU settings (KV cache size, no OpenMP core binding)
    streams = [int(s) for s in args.streams.split(",")] if not SMOKE or args.streams != ap.get_default("streams") else [1, 2]
    seconds = args.seconds or (10.0 if SMOKE else 12.0)
    warmup = args.warmup
    args.max_tokens = args.max_tokens or (32 if SMOKE else 128)
    min_requests = args.min_requests or (2 if SMOKE else 8)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "guidellm").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="speedup-curve-"))
    inputs = smoke_inputs(tmp) if SMOKE else run_inputs(args.run, args.variant)
    turns = first_turns(inputs["prompts"], f"{args.suite}:" if not SMOKE else None)
    data = prompts_file(turns, tmp / "prompts.json")  # the same prompts in both arms
    record = {"inputs": {k: str(v) for k, v in inputs.items()}, "prompts": len(turns), "streams": streams,
              "seconds": seconds, "warmup": warmup, "max_tokens": args.max_tokens, "k": args.k,
              "smoke": SMOKE, "points": [], "servers": {}}
    for arm, draft in (("no draft", None), ("draft", inputs["draft"])):
        tag = "draft" if draft else "nodraft"
        spec = None if draft is None else {"method": "eagle3", "model": str(draft), "num_speculative_tokens": args.k}
        with Server(inputs["target"], spec, inputs["dtype"], args.max_model_len, args.out / f"server-{tag}.log",
                    enforce_eager=SMOKE) as server:
            record["servers"][arm] = {"start_s": round(server.start_s, 1)}
            print(f"[speedup] {arm}: server up in {server.start_s:.0f} s", flush=True)
            for n in streams:
                before = scrape(server.url)
                try:
                    bench = guidellm_point(server.url, n, data, inputs["target"], args.max_tokens, seconds, warmup,
                                           args.out / f"guidellm/{tag}-{n}.json", args.out / f"guidellm-{tag}.log")
                    p = {"arm": arm, "streams": n, **point_figures(bench, before, scrape(server.url))}
                    p["not_measured"] = check_point(p, min_requests)
                except RuntimeError as err:
                    p = {"arm": arm, "streams": n, "not_measured": str(err)}
                record["points"].append(p)
                print(f"[speedup] {arm} @{n}: " + (p["not_measured"] or
                      f"{p['output_tok_s']:,.0f} tok/s, {p['tok_s_per_user']:,.1f} tok/s/user, tau {p['tau']}"), flush=True)
    gain = gain_at_one(record["points"], min(streams))
    if gain:
        record["gain_at_one"] = gain
    md = table(record["points"], streams)
    if "gain_at_one" in record:
        g = record["gain_at_one"]
        md += (f"\nAt {g['streams']} request(s) in flight: per-user gain {g['gain']:.2f} with acceptance length "
               f"{g['tau']:.2f}: {g['gain_over_tau']:.2f} of it.\n")
    atomic_write_json(args.out / "speedup_curve.json", record)
    atomic_write_text(args.out / "speedup_curve.md", md)
    chart(record["points"], args.out / "speedup_curve.png")
    print(md)


if __name__ == "__main__":
    main()
