"""What both measurement jobs do before they measure: settings with defaults, the eval prompts
of every suite rendered for the target, the MeasureSpec, and the engine child's entry point.

Two jobs measure: `acceptance_baseline` (measure_baseline.py: the target alone, once per set
of BASELINE_KEYS values, shared by every variant that has them) and `acceptance`
(measure_acceptance.py: the trained and untrained drafts of one variant)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from .. import runtime
from ..errors import PipelineError
from ..suite_stats import BASE_SUITE, HELD_OUT_SUITE
from ..target import load_config, text_config
from .inputs import MeasureSpec, answer_room, load_eval_prompts

DEFAULTS = {"backend": "vllm", "num_speculative_tokens": 3, "num_prompts": None, "max_tokens": 256,
            "dtype": "float32", "concurrency_one_prompts": 8, "untrained_prompts": None, "reasoning_parser": None,
            "chat_template_kwargs": {}, "trust_remote_code": False, "suites": [], "degenerate": {},
            "batch_size": 64, "speedup_rounds": 3, "speedup_batch_prompts": 16, "speedup_tolerance": 0.25,
            "speedup_engines": "auto"}
# The settings the run without speculation depends on (with the target, the eval prompt and
# suite files): which prompts (num_prompts, suites, chat_template_kwargs, and the context room
# for the answer, max_tokens + num_speculative_tokens, that decides which long prompts are
# skipped), how they are decoded (backend, dtype, max_tokens, batch_size: the transformers
# backend's batches) and how the target loads. Not the draft's: untrained_prompts,
# reasoning_parser and degenerate only read the drafts' outputs; nothing timed either: the
# speedup is measured in the acceptance job (concurrency_one_prompts, speedup_*: speedup.py).
BASELINE_KEYS = ("backend", "num_speculative_tokens", "num_prompts", "max_tokens", "dtype",
                 "batch_size", "chat_template_kwargs", "trust_remote_code", "suites")

# What only the acceptance job's speedup rounds read (speedup.py), from config.yaml `verify`.
SPEEDUP_KEYS = ("speedup_rounds", "speedup_batch_prompts", "speedup_tolerance", "speedup_engines")


def with_speedup_settings(settings_json: str, verify: dict) -> str:
    """The acceptance job's settings: the measurement's (rules/common.smk acceptance_settings)
    and the speedup rounds'."""
    return json.dumps({**json.loads(settings_json), **{k: verify[k] for k in SPEEDUP_KEYS}}, sort_keys=True)


def effective_settings(given: dict) -> dict:
    from .records import BACKENDS

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
    if not isinstance(s["speedup_rounds"], int) or s["speedup_rounds"] < 0 or s["speedup_rounds"] == 1:
        raise PipelineError(f"setting verify.speedup_rounds = {s['speedup_rounds']!r}: must be 0 (no speedup "
                            f"measured) or an integer >= 2 (the speedup's interval is over rounds)")
    if s["dtype"] not in ("float32", "bfloat16", "float16"):
        raise PipelineError(f"setting verify.dtype = {s['dtype']!r}: use float32, bfloat16 or float16")
    return s


def baseline_settings(settings: dict) -> dict:
    return {k: settings[k] for k in BASELINE_KEYS}


def check_target(target: str) -> None:
    if not (Path(target) / "config.json").exists():
        raise PipelineError(f"{target}: target model dir has no config.json; run the target rule first")


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


def add_input_args(p) -> None:
    """The flags both measurement scripts read (the target and the eval prompts)."""
    p.add_argument("--target", help="target model dir (R/target/model)")
    p.add_argument("--prompts", help="eval prompts (R/prompts/eval.jsonl): suite 'eval'")
    p.add_argument("--suite", action="append", default=[], metavar="NAME=PATH",
                   help="a further eval suite's prompts (R/eval_suites/NAME/prompts.jsonl); repeatable")
    # Internal: the script re-runs itself as the child process that holds one vLLM engine.
    p.add_argument("--engine-job", help=argparse.SUPPRESS)
    p.add_argument("--engine-result", help=argparse.SUPPRESS)


def ran_as_engine_child(args) -> bool:
    """Common start of both scripts. A cancelled job (Snakemake, SLURM) sends SIGTERM: unwind,
    so the parent stops its engine child and the child shuts its engine down (a separate
    EngineCore process, as on GPU, was left running by a child killed outright: seen on a
    2-core CPU machine with it forced on). True when this process is an engine child (its job is done)."""
    runtime.setup()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.engine_job:
        return False
    from .vllm_backend import run_engine_jobs

    run_engine_jobs(json.loads(Path(args.engine_job).read_text()), args.engine_result)
    return True


def measure_spec(args, settings: dict, tokenizer, draft: str = "", untrained: str = ""):
    """(spec, skipped prompts, suite of every prompt id): the eval prompts of every suite,
    rendered with the target's chat template, those too long for its context skipped."""
    context_limit = text_config(load_config(args.target)).get("max_position_embeddings")
    room = answer_room(settings["max_tokens"], settings["num_speculative_tokens"])
    prompts, skipped, suite_by_id = [], [], {}
    # verify.num_prompts caps prompts/eval.jsonl only; suites are capped by their num_samples.
    for name, path in [(BASE_SUITE, args.prompts), *suite_files(args.suite)]:
        rows, left = load_eval_prompts(path, settings["num_prompts"] if name == BASE_SUITE else None, tokenizer,
                                       settings["chat_template_kwargs"], context_limit - room if context_limit else None)
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
    spec = MeasureSpec(
        target=str(Path(args.target).resolve()), draft=draft, untrained=untrained, prompts=prompts,
        num_speculative_tokens=settings["num_speculative_tokens"], max_tokens=settings["max_tokens"],
        dtype=settings["dtype"], concurrency_one_prompts=min(settings["concurrency_one_prompts"], len(prompts)),
        untrained_prompts=settings["untrained_prompts"],
        eos_token_ids=eos_token_ids(Path(args.target), tokenizer),
        context_limit=context_limit, batch_size=settings["batch_size"],
        speedup_rounds=settings["speedup_rounds"], speedup_batch_prompts=settings["speedup_batch_prompts"],
        speedup_engines=settings["speedup_engines"],
        trust_remote_code=settings["trust_remote_code"])
    return spec, skipped, suite_by_id
