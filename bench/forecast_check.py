#!/usr/bin/env python
"""Does the forecast hold? A trained draft's measured speedup beside what the forecast stage says
for the same target, draft shape and acceptance, on one accelerator, in one run.

Arms, each a `vllm serve` measured by GuideLLM through the forecast stage's own server and load
code (pipeline_lib/forecast/arms.py), in the order of their value (a run cut short keeps the
finished ones: the record is rewritten after every arm):

  target          the target alone, real weights                             } (a) the measured
  trained         the trained draft at its own acceptance, real weights      }     speedup
  dummy-target    the target alone, dummy weights                            } (c) the forecast as
  forecast-dummy  the forecast's draft (random, the trained draft's shape) at  }     the shape table
                  the tau the trained draft counted, dummy weights            }     makes it
  forecast-real   the same draft with random weights beside the real target  } (b) the forecast with
                  at that tau (vLLM's scalar schedule)                         }     real weights
  forecast-rates  the same at the trained draft's per-position rates          }
  trained-synthetic  the trained draft itself at those rates (isolates the draft's own cost
                  from how its acceptance falls)

Every arm decodes fixed-length answers (max_tokens, ignore_eos) from the same prompts, so the
arms do the same work whatever their weights; the two real-weight reference arms also run the
"natural" load (answers end at EOS, as served) at --natural-concurrency. The speedup of an arm
is its output tok/s over its own no-draft arm's (real or dummy weights) at the same requests in
flight; the error of a forecast arm is its speedup over the trained draft's, minus 1.

vLLM on a CPU has no synthetic sampler ("Synthetic acceptance not supported with CPU sampling"):
there the forecast arms run at their own acceptance (a random draft: about 1.0) and the rates
arms are skipped; the record says so (BENCH_SMOKE=1 rehearses the flow on a CPU).

    python bench/forecast_check.py --target R/target/model --draft R/drafts/default/checkpoint \\
        --prompts R/prompts/eval.jsonl --out bench/.work/forecast-check
    BENCH_SMOKE=1 python bench/forecast_check.py --target ... --out /tmp/fc   # CPU: 1 in flight, short
Writes <out>/forecast_check.json and forecast_check.md; servers' and GuideLLM's logs under <out>/work.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import forecast_speedup  # noqa: E402  (the stage's settings and prompt reader)
from pipeline_lib import draft_types, parallel, runtime  # noqa: E402
from pipeline_lib.forecast import curve, load  # noqa: E402
from pipeline_lib.forecast.arms import (ACCEPTANCE_PROFILES, FIXED, NATURAL, Arm, draft_dir,  # noqa: E402
                                        flag_impossible, measure_arm, synthetic_rates)
from pipeline_lib.io import atomic_write_json, atomic_write_text  # noqa: E402
from pipeline_lib.provenance import accelerator  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
ERROR_LIMIT = 0.15  # a forecast this close to the trained draft's measured speedup counts as holding
REFERENCE = ("target", "trained")
FORECAST_ARMS = ("forecast-dummy", "forecast-real", "forecast-rates", "trained-synthetic")
ALL_ARMS = ("target", "trained", "dummy-target") + FORECAST_ARMS


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="the target's HF directory (R/target/model)")
    p.add_argument("--draft", type=Path, required=True, help="the trained draft (speculators checkpoint dir)")
    p.add_argument("--prompts", type=Path, required=True, help="eval prompts jsonl (first user turns are sent)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--concurrency", default="1" if SMOKE else "1,4,16,64")
    p.add_argument("--natural-concurrency", default="1" if SMOKE else "1,16",
                   help="where the real-weight reference arms also run answers that end at EOS ('' for none)")
    p.add_argument("--seconds", type=float, default=5.0 if SMOKE else 8.0)
    p.add_argument("--max-tokens", type=int, default=16 if SMOKE else 128)
    p.add_argument("--min-requests", type=int, default=1 if SMOKE else 5)
    p.add_argument("--k", type=int, default=None, help="speculative tokens (default: the draft's own)")
    p.add_argument("--acceptance-profile", default="geometric", choices=ACCEPTANCE_PROFILES,
                   help="how the forecast arms accept per position at the trained draft's tau, as the stage's "
                        "forecast.acceptance_profile (the 2026-12-07 record: scalar, before geometric was the default)")
    p.add_argument("--arms", default=",".join(ALL_ARMS), help=f"which arms, in this order ({', '.join(ALL_ARMS)})")
    return p.parse_args()


def draft_settings(draft: Path, k: int | None) -> dict:
    """The forecast settings that describe the trained draft (train.* as the stage reads them)."""
    cfg = json.loads((draft / "config.json").read_text())
    spec = cfg.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    return {"draft_type": spec.get("algorithm") or "eagle3",
            "draft_layers": int((cfg.get("transformer_layer_config") or {}).get("num_hidden_layers") or 1),
            "draft_vocab_size": int(cfg["draft_vocab_size"]),
            "aux_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
            "num_speculative_tokens": int(k or proposals[0].get("speculative_tokens") or 3)}


def pooled_acceptance(points: list[dict]) -> tuple[float | None, list[float] | None]:
    """tau and per-position rates over every measured point given, weighted by its drafts."""
    pts = [p for p in points if not p.get("not_measured") and p.get("drafts")]
    drafts = sum(p["drafts"] for p in pts)
    if not drafts:
        return None, None
    tau = 1 + sum(p["drafts"] * (p["tau"] - 1) for p in pts) / drafts
    with_rates = [p for p in pts if p.get("acceptance_rates")]
    if not with_rates:
        return tau, None
    n = len(with_rates[0]["acceptance_rates"])
    d = sum(p["drafts"] for p in with_rates)
    rates = [sum(p["drafts"] * p["acceptance_rates"][i] for p in with_rates) / d for i in range(n)]
    # vLLM wants them non-increasing; counting noise cannot make a later position more likely
    for i in range(1, n):
        rates[i] = min(rates[i], rates[i - 1])
    return tau, [round(r, 4) for r in rates]


def comparison(points: list[dict], concurrency: list[int]) -> list[dict]:
    """Per concurrency (fixed-length answers): the trained draft's speedup and each forecast arm's,
    with its error against the trained draft's. A missing arm or point gives None, never a guess."""
    rows = curve.speedup_rows(points)
    by = {(r["arm"], r["load"], r["streams"]): r for r in rows}
    out = []
    for n in concurrency:
        measured = by.get(("trained", FIXED, n))
        row = {"streams": n, "measured": measured and measured["speedup"], "measured_tau": measured and measured["tau"]}
        for arm in FORECAST_ARMS:
            r = by.get((arm, FIXED, n))
            row[arm] = r and r["speedup"]
            row[f"{arm}_tau"] = r and r["tau"]
            row[f"{arm}_error"] = (r["speedup"] / measured["speedup"] - 1) if r and measured else None
        natural = by.get(("trained", NATURAL, n))
        row["measured_natural"] = natural and natural["speedup"]
        out.append(row)
    return out


def no_draft_rates(points: list[dict]) -> dict:
    """Output tok/s of the no-draft arms per (arm, load, streams): the scale of each speedup."""
    return {f"{p['tag']}/{p['load']}/{p['streams']}": round(p["output_tok_s"], 1) for p in points
            if p["arm"] == curve.NO_DRAFT and not p.get("not_measured")}


def fmt(x, spec="{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def table_md(record: dict) -> str:
    profile = record.get("acceptance_profile") or "scalar"  # records before the setting: vLLM's scalar schedule
    names = {"forecast-real": f"(b) forecast, real weights, {profile} profile",
             "forecast-rates": "(b) forecast, real weights, the draft's per-position rates",
             "forecast-dummy": f"(c) forecast, dummy weights (shape table), {profile} profile", "trained-synthetic": "trained draft at its rates (synthetic)"}
    head = "| in flight | (a) trained draft, measured | " + " | ".join(f"{names[a]} (error)" for a in FORECAST_ARMS) \
           + " | (a) as served (answers end at EOS) |"
    lines = [head, "|" + "---|" * (len(FORECAST_ARMS) + 3)]
    for r in record["comparison"]:
        cells = []
        for a in FORECAST_ARMS:
            err = r[f"{a}_error"]
            mark = "" if err is None or abs(err) <= ERROR_LIMIT else " **"
            cells.append(f"{fmt(r[a])} at tau {fmt(r[f'{a}_tau'])} ({fmt(err, '{:+.0%}')}){mark}" if r[a] is not None else "-")
        lines.append(f"| {r['streams']} | {fmt(r['measured'])} at tau {fmt(r['measured_tau'])} | " + " | ".join(cells)
                     + f" | {fmt(r['measured_natural'])} |")
    acc = record["accelerator"].get("model") or "CPU"
    text = (f"Speedup = output tok/s with the draft over its own no-draft arm at the same requests in flight; "
            f"{record['settings']['max_tokens']}-token answers (ignore_eos) in every arm unless marked. "
            f"Error = forecast / measured - 1 (** beyond {ERROR_LIMIT:.0%}). {acc}, vLLM {record.get('vllm_version')}; "
            f"trained draft tau {fmt(record['tau'])}, per-position rates {record['rates']}.\n\n")
    note = f"\n{record['note']}\n" if record.get("note") else ""
    return text + "\n".join(lines) + "\n" + note


def write(record: dict, out: Path) -> None:
    flag_impossible(record["points"])
    record["comparison"] = comparison(record["points"], record["settings"]["concurrency"])
    record["no_draft_output_tok_s"] = no_draft_rates(record["points"])
    atomic_write_text(out / "forecast_check.md", table_md(record))
    atomic_write_json(out / "forecast_check.json", record)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the servers' `with` blocks
    runtime.setup()
    on_gpu = runtime.has_cuda()
    conc = [int(c) for c in args.concurrency.split(",")]
    natural = [int(c) for c in args.natural_concurrency.split(",") if c]
    order = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(order) - set(ALL_ARMS)
    if unknown:
        sys.exit(f"--arms: unknown {sorted(unknown)}; known: {', '.join(ALL_ARMS)}")
    s = forecast_speedup.resolve({**draft_settings(args.draft, args.k), "concurrency": conc, "seconds": args.seconds,
                                  "max_tokens": args.max_tokens, "min_requests": args.min_requests,
                                  "tau": [1.0]}, on_gpu)
    out, work = args.out, args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    turns = forecast_speedup.first_turns(args.prompts)
    data = {NATURAL: load.prompts_file(turns, work / "prompts-natural.json"),
            FIXED: load.prompts_file(turns, work / "prompts-fixed.json", output_tokens=s["max_tokens"])}
    common = dict(target=args.target, dtype=s["dtype"], max_model_len=s["max_model_len"], max_num_seqs=max(conc),
                  enforce_eager=not on_gpu, extra_args=parallel.decide().apply().serve_args())
    k = s["num_speculative_tokens"]
    trained_spec = draft_types.speculative_config_for(args.draft, k)
    record = {"settings": s, "target": str(args.target), "draft": str(args.draft), "prompts": len(turns),
              "accelerator": accelerator(), "synthetic": on_gpu, "smoke": SMOKE, "arms": [], "points": [],
              "tau": None, "rates": None, "arm_order": order, "acceptance_profile": args.acceptance_profile,
              "note": None if on_gpu else ("not a check of the forecast: on a CPU vLLM has no synthetic sampler, so the "
                                           "forecast arms ran at their own acceptance and the rates arms were skipped")}
    try:
        import vllm
        record["vllm_version"] = vllm.__version__
    except Exception:  # the record says which vLLM where it can
        record["vllm_version"] = None
    started = time.time()
    random_drafts: dict[bool, dict] = {}

    def forecast_draft(with_weights: bool) -> dict:
        """The forecast stage's own draft of the trained draft's shape: config only (dummy weights)
        or random weights (beside the real target), built once."""
        if with_weights not in random_drafts:
            d = draft_dir(s, args.target, work, with_weights, "draft-random" if with_weights else "draft-config")
            random_drafts[with_weights] = draft_types.speculative_config_for(d, k)
        return random_drafts[with_weights]

    def profile_rates(tau: float) -> list[float] | None:
        return synthetic_rates(tau, k, args.acceptance_profile)

    both = [(FIXED, conc)] + ([(NATURAL, natural)] if natural else [])
    fixed = [(FIXED, conc)]
    for name in order:
        tau, rates = record["tau"], record["rates"]
        synthetic_ok = on_gpu and tau is not None
        if name in ("forecast-rates", "trained-synthetic") and not (on_gpu and rates):
            record["arms"].append({"arm": name, "skipped": "needs the synthetic sampler (a GPU) and the trained "
                                                           "draft's per-position rates"})
            continue
        if name == "target":
            arm = Arm(curve.NO_DRAFT, "target", loads=both)
        elif name == "trained":
            arm = Arm("trained", "trained", trained_spec, loads=both)
        elif name == "dummy-target":
            arm = Arm(curve.NO_DRAFT, "dummy-target", load_format="dummy", loads=fixed)
        elif name == "forecast-dummy":
            arm = Arm(name, name, forecast_draft(False), tau_set=tau if synthetic_ok else None,
                      rates_set=profile_rates(tau) if synthetic_ok else None, load_format="dummy", loads=fixed)
        elif name == "forecast-real":
            arm = Arm(name, name, forecast_draft(True), tau_set=tau if synthetic_ok else None,
                      rates_set=profile_rates(tau) if synthetic_ok else None, loads=fixed)
        elif name == "forecast-rates":
            arm = Arm(name, name, forecast_draft(True), rates_set=rates, loads=fixed)
        else:  # trained-synthetic
            arm = Arm(name, name, trained_spec, rates_set=rates, loads=fixed)
        t = time.time()
        measure_arm(arm, common, s, data, args.target, work, record, log_prefix="[forecast-check]")
        record["arms"][-1]["wall_s"] = round(time.time() - t, 1)
        if name == "trained":
            record["tau"], record["rates"] = pooled_acceptance(
                [p for p in record["points"] if p["arm"] == "trained" and p["load"] == FIXED])
            print(f"[forecast-check] trained draft: tau {record['tau']}, per-position rates {record['rates']}", flush=True)
        record["wall_s"] = round(time.time() - started, 1)
        write(record, out)
    write(record, out)
    print((out / "forecast_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
