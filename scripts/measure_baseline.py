#!/usr/bin/env python
"""Measure the target alone, once for every variant that shares these settings: greedy
decoding of the eval prompts without speculation, all prompts at once and one prompt at a time.
The acceptance job of each such variant reads it (--baseline of measure_acceptance.py) for its
greedy-equality check and its speedups.

Writes R/verify/baseline/<key>.json (<key>: a digest of the settings below, rules/common.smk):
the backend's no-speculation run (per prompt: its output tokens and finish reason; batch and
concurrency-1 wall times, engine start), the settings and a digest of the prompts measured.
If the backend cannot run the target, the file records status "error" with its message and
the script still exits 0: every acceptance.json that reads it records that error.

    python scripts/measure_baseline.py --settings '{"max_tokens": 256}' --target R/target/model \\
        --prompts R/prompts/eval.jsonl --out R/verify/baseline/<key>.json

Settings: the ones of pipeline_lib.acceptance.BASELINE_KEYS (config.yaml `verify`, with the
generation's chat_template_kwargs and the target's trust_remote_code), as measure_acceptance.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli  # noqa: E402
from pipeline_lib.acceptance.job import (add_input_args, check_target, effective_settings, measure_spec,  # noqa: E402
                                         ran_as_engine_child, suite_files)
from pipeline_lib.errors import run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.secrets import scrub  # noqa: E402


def parse_args():
    p = cli.parser(__doc__)
    add_input_args(p)
    p.add_argument("--out", help="baseline file to write (R/verify/baseline/<key>.json)")
    args = p.parse_args()
    if not args.engine_job:
        missing = [f"--{n}" for n in ("target", "prompts", "out") if not getattr(args, n)]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def main() -> int:
    args = parse_args()
    if ran_as_engine_child(args):
        return 0
    settings = effective_settings(args.settings)
    prov = Provenance("acceptance_baseline", settings)
    check_target(args.target)
    started = time.time()

    from transformers import AutoTokenizer

    from pipeline_lib import acceptance as acc

    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=settings["trust_remote_code"])
    spec, skipped, _ = measure_spec(args, settings, tokenizer)
    try:
        run, notes = acc.BACKENDS[settings["backend"]].no_draft(spec, engine_script=str(Path(__file__).resolve()))
        body = {"status": "ok", "error": None, **acc.baseline_body(spec, settings, run, notes)}
        print(f"[acceptance] no_draft: {sum(len(r.token_ids) for r in run.records)} output tokens from "
              f"{len(run.records)} prompts in {run.wall_s:.2f} s", file=sys.stderr)
    except acc.BackendFailure as fail:
        print(f"[acceptance] {fail.run}: the {settings['backend']} backend failed: {fail.message}", file=sys.stderr)
        body = {"status": "error", "error": scrub(fail.message), "error_run": fail.run,
                "error_log_tail": [scrub(line) for line in fail.log_tail],
                **acc.baseline_body(spec, settings, None, [])}
    inputs = {"target": args.target, "prompts": args.prompts, **{f"suite_{n}": p for n, p in suite_files(args.suite)}}
    atomic_write_json(args.out, {**body, "inputs": inputs, "prompts_skipped": skipped,
                                 "wall_s": round(time.time() - started, 2)})
    prov.write(Path(args.out).with_name(Path(args.out).stem + ".provenance.json"), inputs=inputs,
               outputs={"baseline": args.out})
    return 0


if __name__ == "__main__":
    run_main(main)
