#!/usr/bin/env python
"""The speedup forecast: will the draft this run trains make vLLM faster for its target?

Before any data is generated: vLLM serves the run's target (its config and tokenizer; its real
weights, or random ones with forecast.weights: dummy) without a draft, then with the draft the
run will train (train.draft_type, draft_layers, draft_vocab_size; random weights) at each k of
forecast.speculative_token_counts (default: verify.num_speculative_tokens alone) and each
acceptance length of forecast.tau up to that k + 1, which vLLM's synthetic rejection sampler makes
the draft accept on average. Every draft point records its k; the report's serving schedule
chooses among the ks per concurrency. One server per arm; GuideLLM measures each at the
requests in flight of forecast.concurrency (closed-loop streams, a window with its warm-up and
cool-down cut), as bench/speedup_curve.py measures a trained draft. Every point is checked
(failed requests, too few requests, the tau the server counted against the tau asked for, a
per-user gain above tau) and a point that fails is kept with its reason and left out.

Writes --out (forecast.json: points, speedup rows, break-even tau per concurrency), the table
(--table, markdown), the plot (--plot) and provenance.json beside --out.

On a CPU, vLLM refuses synthetic acceptance ("Synthetic acceptance not supported with CPU
sampling"): the draft arm then runs once at its own acceptance (a random draft: about 1.0, or
--draft, a trained draft) and the record says these figures are not a forecast.

    python scripts/forecast_speedup.py --settings @forecast.json --target R/target/model \\
        --prompts R/prompts/eval.jsonl --out R/forecast/forecast.json \\
        --table R/forecast/forecast.md --plot R/forecast/forecast.png --work R/logs/forecast
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, dtypes, parallel, runtime  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.forecast import curve, load  # noqa: E402
# flag_impossible: the tests call it here
from pipeline_lib.forecast.arms import (NATURAL, Arm, draft_dir, flag_impossible, measure_arm,  # noqa: E402,F401
                                        synthetic_rates)
from pipeline_lib.io import atomic_write_json, atomic_write_text, read_jsonl  # noqa: E402
from pipeline_lib.provenance import Provenance, accelerator  # noqa: E402

DEFAULTS = {"weights": "real", "tau": [1.0, 1.5, 2.0, 2.5, 3.0, 4.0], "concurrency": [1, 4, 16, 64],
            "seconds": 12.0, "warmup": 0.1, "max_tokens": 128, "min_requests": 8, "max_model_len": 2048,
            "dtype": "auto", "draft_type": "eagle3", "draft_layers": 1, "draft_vocab_size": 32000,
            "num_speculative_tokens": 3, "speculative_token_counts": None, "aux_layer_ids": None,
            "acceptance_profile": "geometric"}


def parse_args():
    p = cli.parser(__doc__)
    p.add_argument("--target", type=Path, required=True, help="the target's HF directory (R/target/model)")
    p.add_argument("--prompts", type=Path, required=True, help="eval prompts (jsonl with messages); first user turns are sent")
    p.add_argument("--out", type=Path, required=True, help="forecast.json to write")
    p.add_argument("--table", type=Path, help="markdown table to write (default: beside --out)")
    p.add_argument("--plot", type=Path, help="PNG plot to write (default: beside --out)")
    p.add_argument("--work", type=Path, help="servers' and GuideLLM's logs (default: <out dir>/work)")
    p.add_argument("--draft", type=Path, help="a trained draft to measure at its own acceptance instead of "
                                              "synthetic tau points (a check of the method, not a forecast)")
    p.add_argument("--label", default=None, help="the shape's name in the table title (default: the target dir)")
    return p.parse_args()


def first_turns(path: Path) -> list[str]:
    turns = []
    for line_no, row in read_jsonl(path):
        user = next((m.get("content") for m in row.get("messages") or [] if m.get("role") == "user"), None)
        if not isinstance(user, str) or not user.strip():
            raise PipelineError(f"{path}:{line_no}: no user message with text; the forecast sends each row's "
                                f"first user turn (rows of prompts/eval.jsonl have one)")
        turns.append(user)
    if not turns:
        raise PipelineError(f"{path}: no prompts; the forecast needs at least one")
    return turns


def resolve(settings: dict, on_gpu: bool) -> dict:
    s = {**DEFAULTS, **{k: v for k, v in settings.items() if v is not None or k == "aux_layer_ids"}}
    # verify's k always: the report places the trained draft at the k its acceptance was counted with
    s["speculative_token_counts"] = sorted({int(k) for k in s["speculative_token_counts"] or []}
                                           | {s["num_speculative_tokens"]})
    k = max(s["speculative_token_counts"])
    where = (f"verify.num_speculative_tokens = {k}" if s["speculative_token_counts"] == [s["num_speculative_tokens"]]
             else f"the largest of forecast.speculative_token_counts = {s['speculative_token_counts']}")
    s["tau"] = sorted({float(t) for t in s["tau"]})
    bad = [t for t in s["tau"] if not 1.0 <= t <= k + 1]
    if bad:
        raise PipelineError(f"forecast.tau = {bad}: an acceptance length lies between 1 (nothing accepted) "
                            f"and k + 1 = {k + 1} ({where}); drop or lower them")
    if s["dtype"] == "auto":  # the workflow resolved it already; here for a direct call (bench/)
        s["dtype"] = dtypes.resolve_one({"forecast": {"dtype": "auto"}, "resources": {"forecast": {"gpu": int(on_gpu)}}},
                                        "forecast", dtypes.cpu())["dtype"]
    s["concurrency"] = sorted({int(c) for c in s["concurrency"]})
    return s


def draft_arms(s: dict, specs: dict[int, dict], synthetic: bool, load_format: str | None, loads: list) -> list[Arm]:
    """Per k: one arm per tau it can reach (tau <= k + 1) with synthetic acceptance, else one arm
    at the draft's own acceptance. Tags name the k only where there are several (one k: the
    tags of earlier records)."""
    prefix = {k: "" if len(specs) == 1 else f"k{k}-" for k in specs}
    if not synthetic:
        return [Arm("draft", f"{prefix[k]}draft", spec, k=k, load_format=load_format, loads=loads)
                for k, spec in specs.items()]
    return [Arm("draft", f"{prefix[k]}tau-{tau}", spec, k=k, tau_set=tau,
                rates_set=synthetic_rates(tau, k, s["acceptance_profile"]), load_format=load_format, loads=loads)
            for k, spec in specs.items() for tau in s["tau"] if tau <= k + 1]


def main() -> int:
    args = parse_args()
    # A SIGTERM (a time budget, Snakemake's own stop) unwinds the `with Server` blocks, which stop
    # their servers: a server left running would hold the GPU from the next job.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runtime.setup()
    on_gpu = runtime.has_cuda()
    s = resolve(args.settings, on_gpu)
    prov = Provenance("forecast", s)
    if not (args.target / "config.json").exists():
        raise PipelineError(f"{args.target}: no config.json; --target must be the target's HF directory")
    turns = first_turns(args.prompts)
    work = args.work or args.out.parent / "work"
    work.mkdir(parents=True, exist_ok=True)
    data = load.prompts_file(turns, work / "prompts.json")
    dummy = s["weights"] == "dummy"
    started = time.time()
    common = dict(target=args.target, dtype=s["dtype"], max_model_len=s["max_model_len"],
                  max_num_seqs=max(s["concurrency"]),
                  enforce_eager=not on_gpu, extra_args=parallel.decide().apply().serve_args())
    # Synthetic acceptance needs vLLM's GPU sampler; a trained --draft is measured as it accepts.
    synthetic = on_gpu and args.draft is None
    ks = s["speculative_token_counts"]
    # One draft for every k, written at the largest: vLLM serves a draft at any k up to its own.
    draft = args.draft or draft_dir({**s, "num_speculative_tokens": max(ks)}, args.target, work, with_weights=not dummy)
    from pipeline_lib import draft_types
    specs = {k: draft_types.speculative_config_for(draft, k) for k in ks}
    record = {"settings": s, "target": str(args.target), "draft": str(draft), "label": args.label or args.target.name,
              "target_config": {k: v for k, v in json.loads((args.target / "config.json").read_text()).items()
                                if k in ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                                         "num_attention_heads", "num_key_value_heads", "vocab_size")},
              "accelerator": accelerator(), "prompts": len(turns), "synthetic": synthetic,
              "is_forecast": synthetic,
              "note": None if synthetic else (
                  "not a forecast: vLLM's synthetic acceptance needs a GPU sampler (on a CPU: 'Synthetic "
                  "acceptance not supported with CPU sampling'), so the draft ran once at its own acceptance"
                  if args.draft is None else "not a forecast: a trained draft measured at its own acceptance"),
              "arms": [], "points": []}
    try:
        import vllm
        record["vllm_version"] = vllm.__version__
    except Exception:  # the record says which vLLM where it can
        record["vllm_version"] = None
    loads, weights = [(NATURAL, s["concurrency"])], "dummy" if dummy else None
    arms = [Arm(curve.NO_DRAFT, "nodraft", load_format=weights, loads=loads)] + draft_arms(s, specs, synthetic, weights, loads)
    for arm in arms:
        measure_arm(arm, common, s, {NATURAL: data}, args.target, work, record)
    flag_impossible(record["points"])
    record.update(curve.summary(record["points"], s["concurrency"], ks, s["num_speculative_tokens"]))
    record["wall_s"] = round(time.time() - started, 1)
    title = (f"{record['label']}: {s['draft_type']} draft, {s['draft_layers']} layer(s), draft vocab "
             f"{s['draft_vocab_size']:,}, k {', '.join(map(str, ks))}, {record['accelerator'].get('name') or 'CPU'}")
    md = f"Speedup (output tok/s with the draft over without, at equal requests in flight), {title}\n"
    for k in ks:
        md += ("\n" if len(ks) == 1 else f"\nk {k}:\n\n") + curve.table_md(record["points"], s["concurrency"], k, s["num_speculative_tokens"])
    if record["note"]:
        md += f"\n{record['note']}.\n"
    table, plot = args.table or args.out.with_suffix(".md"), args.plot or args.out.with_suffix(".png")
    curve.plot(record["points"], s["concurrency"], plot, title, ks, s["num_speculative_tokens"])
    atomic_write_text(table, md)
    atomic_write_json(args.out, record)  # last: its presence means the others are complete
    prov.write(args.out.with_name("provenance.json"), inputs={"target": str(args.target), "prompts": str(args.prompts)},
               outputs={"forecast": str(args.out), "table": str(table), "plot": str(plot)},
               dtype_resolution=dtypes.job_record("forecast", s["dtype"], on_gpu=on_gpu))
    print(md)
    return 0


if __name__ == "__main__":
    run_main(main)
