#!/usr/bin/env python
"""Measure how well an EAGLE-3 draft speculates for its target: greedy decoding of the eval
prompts with the trained draft and with the untrained draft; the run without speculation comes
from --baseline, the acceptance_baseline job's file (measure_baseline.py), which every variant
with the same baseline settings (pipeline_lib.acceptance.BASELINE_KEYS) shares.

Writes acceptance.json: mean acceptance length, per-position acceptance rates, drafts / draft
tokens / accepted tokens, per-category and (for reasoning targets) per reasoning/answer span
acceptance, output tokens/s with and without the draft (verify.speedup_batch_prompts prompts at
once and verify.concurrency_one_prompts one at a time) measured here in interleaved rounds, the
speedup with its interval or why it is not measured (pipeline_lib.acceptance.speedup), and a
token-by-token comparison of greedy outputs with and without speculation.

Several eval suites are measured in one job: --prompts (suite `eval`) and one --suite NAME=PATH
per verify.suites entry; each request row records its suite and whether its answer is
degenerate (empty, or ending in a loop: pipeline_lib.suite_stats), the loop decoded as text.

If the backend cannot load the draft, acceptance.json records status "error" with the
backend's own message and the script still exits 0, so the report can show it.

    python scripts/measure_acceptance.py --settings '{"num_speculative_tokens": 3}' \\
        --target R/target/model --draft R/drafts/default/final \\
        --untrained R/drafts/default/untrained --prompts R/prompts/eval.jsonl \\
        --baseline R/verify/baseline/<key>.json --out R/drafts/default/verify/acceptance.json

Settings (config.yaml `verify`): backend (vllm | transformers), num_speculative_tokens,
num_prompts (null = all), max_tokens, dtype (float32 on CPU: greedy equality is exact only
in fp32), concurrency_one_prompts, untrained_prompts (null = all), reasoning_parser, batch_size
(transformers backend: prompts per batched pass), speedup_rounds, speedup_batch_prompts,
speedup_tolerance (speedup_rounds 0: no speedup measured); optional
chat_template_kwargs and trust_remote_code.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, dtypes  # noqa: E402
from pipeline_lib.acceptance.job import (add_input_args, check_target, effective_settings,  # noqa: E402,F401
                                         eos_token_ids, measure_spec, ran_as_engine_child, suite_files, suite_of)
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.secrets import scrub  # noqa: E402
from pipeline_lib.suite_stats import BASE_SUITE, degenerate_answer  # noqa: E402


def parse_args():
    p = cli.parser(__doc__)
    add_input_args(p)
    p.add_argument("--draft", help="trained draft checkpoint dir (R/drafts/<variant>/final)")
    p.add_argument("--untrained", help="untrained draft dir, the baseline (R/drafts/<variant>/untrained)")
    p.add_argument("--baseline", help="the run without speculation (R/verify/baseline/<key>.json)")
    p.add_argument("--out", help="acceptance.json to write")
    args = p.parse_args()
    if not args.engine_job:
        missing = [f"--{n}" for n in ("target", "draft", "untrained", "prompts", "baseline", "out")
                   if not getattr(args, n)]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def check_inputs(args) -> None:
    # The eval prompts are checked by load_eval_prompts, the baseline by load_baseline; the
    # draft dirs are left for the backend to judge (a draft it cannot load is a measurement result, not a crash).
    check_target(args.target)
    for flag, path in (("--draft", args.draft), ("--untrained", args.untrained)):
        if not Path(path).is_dir():
            raise PipelineError(f"{path} ({flag}): draft dir not found; run the train_draft rule first")


def annotate_requests(requests: dict[str, list[dict]], runs: dict, suite_by_id: dict[str, str], tokenizer,
                      degenerate_settings: dict) -> None:
    """Each request row gets its suite and, when its answer is empty or ends in a loop, what
    the loop is (decoded: what a reader sees)."""
    for name, rows in requests.items():
        for row, rec in zip(rows, runs[name].records):
            row["suite"] = suite_by_id.get(rec.id, BASE_SUITE)
            found = degenerate_answer(rec.token_ids, degenerate_settings)
            if found and found["kind"] == "loop":
                found["text"] = tokenizer.decode(rec.token_ids[found["start"]:found["start"] + found["period"]])
            row["degenerate"] = found


def main() -> int:
    args = parse_args()
    if ran_as_engine_child(args):
        return 0
    settings = effective_settings(args.settings)
    prov = Provenance("acceptance", settings)
    check_inputs(args)
    started = time.time()

    from transformers import AutoTokenizer

    from pipeline_lib import acceptance as acc

    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=settings["trust_remote_code"])
    spec, skipped, suite_by_id = measure_spec(args, settings, tokenizer, draft=str(Path(args.draft).resolve()),
                                              untrained=str(Path(args.untrained).resolve()))
    end_id, marker_or_reason = acc.reasoning_end_token_id(tokenizer, settings["reasoning_parser"])
    spec.reasoning_end_token_id = end_id
    prompts = spec.prompts

    header = {
        "backend": settings["backend"], "settings": settings,
        "inputs": {"target": args.target, "draft": args.draft, "untrained": args.untrained, "prompts": args.prompts,
                   "suites": dict(suite_files(args.suite)), "baseline": args.baseline},
        "suites": {name: sum(s == name for s in suite_by_id.values()) for name in dict.fromkeys(suite_by_id.values())},
        "num_prompts": len(prompts), "prompts_skipped": skipped, "num_speculative_tokens": spec.num_speculative_tokens,
        "max_tokens": spec.max_tokens, "dtype": spec.dtype,
        "greedy_equality_expected": spec.dtype == "float32",
    }
    if settings["reasoning_parser"] and end_id is None:
        header["spans_unavailable"] = marker_or_reason
    try:
        no_draft = acc.load_baseline(args.baseline, spec, settings)
        backend = acc.BACKENDS[settings["backend"]]
        runs, notes = backend.drafts(spec, engine_script=str(Path(__file__).resolve()))
        runs["no_draft"] = no_draft
        if not spec.speedup_rounds:  # asked for none: no engines started for it
            rounds, cost = [], {"not_asked": "verify.speedup_rounds is 0"}
        else:
            try:  # the acceptance numbers stand without the speedup: a failed round is its own "not measured"
                rounds, cost = backend.speedup(spec, engine_script=str(Path(__file__).resolve()))
            except acc.BackendFailure as fail:
                print(f"[acceptance] {fail.run}: {fail.message}", file=sys.stderr)
                rounds, cost = [], {"error": scrub(f"{fail.run}: {fail.message}")}
        trained = runs["trained"].global_block or acc.steps_block(
            [s for r in runs["trained"].records for s in acc.request_steps(r)], spec.num_speculative_tokens)
        throughput = acc.throughput(
            rounds, {s: trained["mean_acceptance_length"] for s in ("batch", "concurrency_1")},
            settings["speedup_tolerance"], {"batch": len(spec.speedup_batch), "concurrency_1": len(spec.concurrency_one)},
            cost.get("error") or cost.get("not_asked"))
        body = {"status": "ok", "error": None,
                **acc.assemble(spec, settings["backend"], runs, notes, marker_or_reason if end_id is not None else None,
                               throughput)}
        body["timing"]["speedup_engines"] = cost
        annotate_requests(body["requests"], runs, suite_by_id, tokenizer, settings["degenerate"])
        summary = body["acceptance"]["trained"]
        t = body["throughput"]
        print(f"[acceptance] trained draft: mean acceptance length {summary['mean_acceptance_length']}, "
              f"per position {summary['acceptance_rate_per_position']}; untrained: "
              f"{body['acceptance']['untrained']['mean_acceptance_length']}; speedup at {t['speedup_measured_at']}: "
              + (f"{t['speedup']:.2f}, 95% interval {t['speedup_interval'][0]:.2f}-{t['speedup_interval'][1]:.2f}"
                 if t["speedup"] is not None else f"not measured ({t['speedup_not_measured']})"), file=sys.stderr)
    except acc.BackendFailure as fail:
        print(f"[acceptance] {fail.run}: the {settings['backend']} backend failed: {fail.message}", file=sys.stderr)
        body = {"status": "error", "error": scrub(fail.message), "error_run": fail.run,
                "error_log_tail": [scrub(line) for line in fail.log_tail]}
    record = {**header, **body, "wall_s": round(time.time() - started, 2)}
    atomic_write_json(args.out, record)
    prov.write(Path(args.out).with_name(Path(args.out).stem + ".provenance.json"),
               inputs={"target": args.target, "draft": args.draft, "untrained": args.untrained,
                       "prompts": args.prompts, "baseline": args.baseline,
                       **{f"suite_{n}": p for n, p in suite_files(args.suite)}},
               outputs={"acceptance": args.out},
               dtype_resolution=dtypes.job_record("verify", spec.dtype))
    return 0


if __name__ == "__main__":
    run_main(main)
