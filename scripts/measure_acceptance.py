#!/usr/bin/env python
"""Measure how well an EAGLE-3 draft speculates for its target: greedy decoding of the eval
prompts with the trained draft, with the untrained draft (baseline) and without speculation.

Writes acceptance.json: mean acceptance length, per-position acceptance rates, drafts / draft
tokens / accepted tokens, per-category and (for reasoning targets) per reasoning/answer span
acceptance, output tokens/s with and without the draft (all prompts at once and one prompt at
a time), and a token-by-token comparison of greedy outputs with and without speculation.

Several eval suites are measured in one job: --prompts (suite `eval`) and one --suite NAME=PATH
per verify.suites entry; each request row records its suite and whether its answer is
degenerate (empty, or ending in a loop: pipeline_lib.suite_stats), the loop decoded as text.

If the backend cannot load the draft, acceptance.json records status "error" with the
backend's own message and the script still exits 0, so the report can show it.

    python scripts/measure_acceptance.py --settings '{"num_speculative_tokens": 3}' \\
        --target R/target/model --draft R/drafts/default/final \\
        --untrained R/drafts/default/untrained --prompts R/prompts/eval.jsonl \\
        --out R/drafts/default/verify/acceptance.json

Settings (config.yaml `verify`): backend (vllm | transformers), num_speculative_tokens,
num_prompts (null = all), max_tokens, dtype (float32 on CPU: greedy equality is exact only
in fp32), concurrency_one_prompts, untrained_prompts (null = all), reasoning_parser, batch_size
(transformers backend: prompts per batched pass); optional
chat_template_kwargs and trust_remote_code.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.secrets import scrub  # noqa: E402
from pipeline_lib.suite_stats import BASE_SUITE, HELD_OUT_SUITE, degenerate_answer  # noqa: E402
from pipeline_lib.target import load_config, text_config  # noqa: E402

DEFAULTS = {"backend": "vllm", "num_speculative_tokens": 3, "num_prompts": None, "max_tokens": 256,
            "dtype": "float32", "concurrency_one_prompts": 8, "untrained_prompts": None, "reasoning_parser": None,
            "chat_template_kwargs": {}, "trust_remote_code": False, "suites": [], "degenerate": {},
            "batch_size": 64}


def parse_args() -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--target", help="target model dir (R/target/model)")
    p.add_argument("--draft", help="trained draft checkpoint dir (R/drafts/<variant>/final)")
    p.add_argument("--untrained", help="untrained draft dir, the baseline (R/drafts/<variant>/untrained)")
    p.add_argument("--prompts", help="eval prompts (R/prompts/eval.jsonl): suite 'eval'")
    p.add_argument("--suite", action="append", default=[], metavar="NAME=PATH",
                   help="a further eval suite's prompts (R/eval_suites/NAME/prompts.jsonl); repeatable")
    p.add_argument("--out", help="acceptance.json to write")
    # Internal: this script re-runs itself as the child process that holds one vLLM engine.
    p.add_argument("--engine-job", help=argparse.SUPPRESS)
    p.add_argument("--engine-result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.engine_job:
        missing = [f"--{n}" for n in ("target", "draft", "untrained", "prompts", "out") if not getattr(args, n)]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def effective_settings(given: dict) -> dict:
    from pipeline_lib.acceptance import BACKENDS

    s = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None or k == "num_prompts"}}
    if s["backend"] not in BACKENDS:
        raise PipelineError(f"setting verify.backend = {s['backend']!r}: unknown; use one of {sorted(BACKENDS)}")
    if not isinstance(s["num_speculative_tokens"], int) or s["num_speculative_tokens"] < 1:
        raise PipelineError(f"setting verify.num_speculative_tokens = {s['num_speculative_tokens']!r}: "
                            f"must be an integer >= 1")
    if s["untrained_prompts"] is not None and (not isinstance(s["untrained_prompts"], int)
                                               or s["untrained_prompts"] < 1):
        raise PipelineError(f"setting verify.untrained_prompts = {s['untrained_prompts']!r}: must be null "
                            f"(all eval prompts) or an integer >= 1")
    if s["dtype"] not in ("float32", "bfloat16", "float16"):
        raise PipelineError(f"setting verify.dtype = {s['dtype']!r}: use float32, bfloat16 or float16")
    return s


def check_inputs(args) -> None:
    # The eval prompts are checked by load_eval_prompts; the draft dirs are left for the backend
    # to judge (a draft it cannot load is a measurement result, not a crash).
    target = Path(args.target)
    if not (target / "config.json").exists():
        raise PipelineError(f"{target}: target model dir has no config.json; run the target rule first")
    for flag, path in (("--draft", args.draft), ("--untrained", args.untrained)):
        if not Path(path).is_dir():
            raise PipelineError(f"{path} ({flag}): draft dir not found; run the train_draft rule first")


def eos_token_ids(target: Path, tokenizer) -> list[int]:
    ids = set()
    for name in ("generation_config.json", "config.json"):
        p = target / name
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(int(i) for i in ids)


def suite_files(values: list[str]) -> list[tuple[str, str]]:
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path or name in (BASE_SUITE, HELD_OUT_SUITE):
            raise PipelineError(f"--suite {value!r}: expected NAME=PATH with a NAME other than {BASE_SUITE!r} "
                                f"or {HELD_OUT_SUITE!r}")
        out.append((name, path))
    return out


def suite_of(file_suite: str, category: str | None) -> str:
    """The suite a prompt is reported under: its file's, except that prompts/eval.jsonl's
    held-out training prompts (traffic the draft was trained for, not the eval source) are a
    suite of their own, so each of the two figures gets its own interval."""
    return HELD_OUT_SUITE if file_suite == BASE_SUITE and category == HELD_OUT_SUITE else file_suite


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
    runtime.setup()
    # A cancelled job (Snakemake, SLURM) sends SIGTERM: unwind, so the parent stops its engine
    # child and the child shuts its engine down (a separate EngineCore process, as on GPU, was
    # left running by a child killed outright: seen on the CPU box with it forced on).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.engine_job:
        from pipeline_lib.acceptance import run_engine_job

        result = run_engine_job(json.loads(Path(args.engine_job).read_text()))
        atomic_write_json(args.engine_result, result)
        return 0

    settings = effective_settings(args.settings)
    prov = Provenance("acceptance", settings)
    check_inputs(args)
    started = time.time()

    from transformers import AutoTokenizer

    from pipeline_lib import acceptance as acc

    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=settings["trust_remote_code"])
    context_limit = text_config(load_config(args.target)).get("max_position_embeddings")
    room = acc.answer_room(settings["max_tokens"], settings["num_speculative_tokens"])
    prompts, skipped, suite_by_id = [], [], {}
    # verify.num_prompts caps prompts/eval.jsonl only; suites are capped by their num_samples.
    for name, path in [(BASE_SUITE, args.prompts), *suite_files(args.suite)]:
        rows, left = acc.load_eval_prompts(path, settings["num_prompts"] if name == BASE_SUITE else None, tokenizer,
                                           settings["chat_template_kwargs"],
                                           context_limit - room if context_limit else None)
        for row in left:
            print(f"[acceptance] {path}:{row['line']}: prompt {row['id']} has {row['prompt_tokens']} tokens, more "
                  f"than the {row['max_prompt_tokens']} the target's context leaves; skipped", file=sys.stderr)
        clash = next((r.id for r in rows if r.id in suite_by_id), None)
        if clash:
            raise PipelineError(f"{path}: prompt id {clash!r} also appears in suite {suite_by_id[clash]!r}; "
                                f"ids must be unique across suites (rerun eval_suite)")
        suite_by_id.update((r.id, suite_of(name, r.category)) for r in rows)
        prompts += rows
        skipped += [{**row, "suite": name} for row in left]
    end_id, marker_or_reason = acc.reasoning_end_token_id(tokenizer, settings["reasoning_parser"])
    spec = acc.MeasureSpec(
        target=str(Path(args.target).resolve()), draft=str(Path(args.draft).resolve()),
        untrained=str(Path(args.untrained).resolve()), prompts=prompts,
        num_speculative_tokens=settings["num_speculative_tokens"], max_tokens=settings["max_tokens"],
        dtype=settings["dtype"], concurrency_one_prompts=min(settings["concurrency_one_prompts"], len(prompts)),
        untrained_prompts=settings["untrained_prompts"],
        eos_token_ids=eos_token_ids(Path(args.target), tokenizer), reasoning_end_token_id=end_id,
        context_limit=context_limit, batch_size=settings["batch_size"],
        trust_remote_code=settings["trust_remote_code"])

    header = {
        "backend": settings["backend"], "settings": settings,
        "inputs": {"target": args.target, "draft": args.draft, "untrained": args.untrained, "prompts": args.prompts,
                   "suites": dict(suite_files(args.suite))},
        "suites": {name: sum(s == name for s in suite_by_id.values()) for name in dict.fromkeys(suite_by_id.values())},
        "num_prompts": len(prompts), "prompts_skipped": skipped, "num_speculative_tokens": spec.num_speculative_tokens,
        "max_tokens": spec.max_tokens, "dtype": spec.dtype,
        "greedy_equality_expected": spec.dtype == "float32",
    }
    if settings["reasoning_parser"] and end_id is None:
        header["spans_unavailable"] = marker_or_reason
    try:
        runs, notes = acc.BACKENDS[settings["backend"]](spec, engine_script=str(Path(__file__).resolve()))
        body = {"status": "ok", "error": None,
                **acc.assemble(spec, settings["backend"], runs, notes, marker_or_reason if end_id is not None else None)}
        annotate_requests(body["requests"], runs, suite_by_id, tokenizer, settings["degenerate"])
        summary = body["acceptance"]["trained"]
        print(f"[acceptance] trained draft: mean acceptance length {summary['mean_acceptance_length']}, "
              f"per position {summary['acceptance_rate_per_position']}; untrained: "
              f"{body['acceptance']['untrained']['mean_acceptance_length']}; "
              f"speedup {body['throughput']['speedup']} ({body['throughput']['speedup_measured_at']})", file=sys.stderr)
    except acc.BackendFailure as fail:
        print(f"[acceptance] {fail.run}: the {settings['backend']} backend failed: {fail.message}", file=sys.stderr)
        body = {"status": "error", "error": scrub(fail.message), "error_run": fail.run,
                "error_log_tail": [scrub(line) for line in fail.log_tail]}
    record = {**header, **body, "wall_s": round(time.time() - started, 2)}
    atomic_write_json(args.out, record)
    prov.write(Path(args.out).with_name(Path(args.out).stem + ".provenance.json"),
               inputs={"target": args.target, "draft": args.draft, "untrained": args.untrained,
                       "prompts": args.prompts, **{f"suite_{n}": p for n, p in suite_files(args.suite)}},
               outputs={"acceptance": args.out})
    return 0


if __name__ == "__main__":
    run_main(main)
