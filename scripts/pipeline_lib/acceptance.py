"""Acceptance of an EAGLE-3 draft: how many drafted tokens the target accepts under greedy
speculative decoding, measured by a backend picked from BACKENDS.

- `vllm` (default): real vLLM serves the target with the draft as its EAGLE-3 speculator.
  Every engine configuration (trained draft, untrained draft, no speculation) runs in its own
  child process (one engine at a time, memory returned between them, vLLM's own error
  message captured if it cannot load the draft). Global numbers come from vLLM's spec-decode
  metrics (`llm.get_metrics()`); per-request numbers (categories, reasoning/answer spans) from
  vLLM's per-request detailed metrics, which list the accepted count of every verify step.
- `transformers`: chain speculation written out with the same models: speculators' Eagle3
  draft proposes k tokens from the target's aux hidden states, the target verifies them in
  one forward over its KV cache. For targets vLLM cannot run, and as a cross-check of vLLM.

Both backends produce the same per-request step records; everything after that (summaries,
categories, spans, greedy equality) is shared code, so the two outputs have one schema.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import PipelineError
from .io import read_jsonl

# The token that closes the reasoning section, per vLLM reasoning parser name. Anything not
# listed uses DEFAULT_REASONING_END (the <think>...</think> convention of most parsers).
REASONING_END_MARKERS = {"mistral": "[/THINK]"}
DEFAULT_REASONING_END = "</think>"


# ---------------------------------------------------------------------------------------------
# Inputs shared by the backends


@dataclass
class EvalPrompt:
    id: str
    category: str | None
    token_ids: list[int]


@dataclass
class MeasureSpec:
    """Everything a backend needs; built once by measure_acceptance.py."""

    target: str
    draft: str
    untrained: str
    prompts: list[EvalPrompt]
    num_speculative_tokens: int
    max_tokens: int
    dtype: str
    concurrency_one_prompts: int
    eos_token_ids: list[int]
    untrained_prompts: int | None = None  # None = all; else that many, round-robin over categories
    reasoning_end_token_id: int | None = None
    context_limit: int | None = None     # the target's max_position_embeddings
    trust_remote_code: bool = False
    seed: int = 0
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def concurrency_one(self) -> list[EvalPrompt]:
        return self.prompts[: self.concurrency_one_prompts]

    @property
    def untrained_subset(self) -> list[EvalPrompt]:
        """The prompts the untrained baseline runs on: all, or `untrained_prompts` of them taken
        round-robin over the categories (the first of each category, then the second, ...), so
        every category has a baseline; in eval-set order. The baseline only shows that a draft
        with random weights gets ~1.0, and its engine run costs as much as the trained draft's
        (minutes on a small CPU box)."""
        if self.untrained_prompts is None or self.untrained_prompts >= len(self.prompts):
            return list(self.prompts)
        by_category: dict[str | None, list[int]] = {}
        for i, p in enumerate(self.prompts):
            by_category.setdefault(p.category, []).append(i)
        picked: list[int] = []
        for rank in range(max(len(v) for v in by_category.values())):
            picked += [idx[rank] for idx in by_category.values() if rank < len(idx)]
        return [self.prompts[i] for i in sorted(picked[: self.untrained_prompts])]


def load_eval_prompts(path: str | Path, num_prompts: int | None, tokenizer,
                      chat_template_kwargs: dict | None = None,
                      max_prompt_tokens: int | None = None) -> tuple[list[EvalPrompt], list[dict]]:
    """(prompts, skipped): the first `num_prompts` rows of prompts/eval.jsonl, rendered with
    the target's chat template (generation prompt added) so both backends see identical token
    ids. Rows longer than `max_prompt_tokens` (the target's context minus the answer budget)
    cannot be measured; they are skipped and listed, not allowed to fail the engine."""
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"{path}: eval prompts file not found; run the prompts_eval rule "
                            f"(snakemake ... prompts_eval) or fix prompts.eval.source")
    prompts, skipped, rows_read = [], [], 0
    for lineno, row in read_jsonl(path):
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
            raise PipelineError(f"{path}:{lineno}: 'messages' must be a non-empty list ending with a "
                                f"user turn (see docs/artifacts.md, prompts/eval.jsonl)")
        if "id" not in row:
            raise PipelineError(f"{path}:{lineno}: row has no 'id'")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **(chat_template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        rows_read += 1
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            skipped.append({"id": str(row["id"]), "line": lineno, "prompt_tokens": len(ids),
                            "max_prompt_tokens": max_prompt_tokens})
        else:
            prompts.append(EvalPrompt(id=str(row["id"]), category=row.get("category"), token_ids=list(map(int, ids))))
        if num_prompts is not None and rows_read >= num_prompts:
            break
    if not prompts:
        why = f" ({len(skipped)} longer than {max_prompt_tokens} tokens)" if skipped else ""
        raise PipelineError(f"{path}: no prompts the target can answer{why}; the eval set is empty")
    return prompts, skipped


def reasoning_end_token_id(tokenizer, parser: str | None) -> tuple[int | None, str | None]:
    """(token id, marker) that ends the reasoning span, or (None, reason) when not applicable."""
    if not parser:
        return None, None
    marker = REASONING_END_MARKERS.get(parser, DEFAULT_REASONING_END)
    tid = tokenizer.convert_tokens_to_ids(marker)
    if tid is None or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(tid) != marker:
        return None, f"reasoning parser {parser}: marker {marker!r} is not a single token of the target's tokenizer"
    return int(tid), marker


# ---------------------------------------------------------------------------------------------
# Step records -> numbers (shared by both backends)


@dataclass
class RequestRecord:
    """One prompt's greedy output and, with speculation, the accepted/drafted count of every
    verify step in order (step j drafts the output tokens right after the ones emitted so far)."""

    id: str
    category: str | None
    token_ids: list[int]
    finish_reason: str | None = None
    steps_accepted: list[int] | None = None
    steps_drafted: list[int] | None = None


def acceptance_block(num_drafts: int, num_draft_tokens: int, accepted_per_pos: list[int]) -> dict[str, Any]:
    accepted = int(sum(accepted_per_pos))
    return {
        "num_drafts": int(num_drafts),
        "num_draft_tokens": int(num_draft_tokens),
        "num_accepted_tokens": accepted,
        "accepted_per_position": [int(x) for x in accepted_per_pos],
        # EAGLE's tau: tokens emitted per target forward (accepted drafts + the target's own token).
        "mean_acceptance_length": (1.0 + accepted / num_drafts) if num_drafts else None,
        "acceptance_rate_per_position": [x / num_drafts for x in accepted_per_pos] if num_drafts else None,
        "draft_acceptance_rate": accepted / num_draft_tokens if num_draft_tokens else None,
    }


def steps_block(steps: list[tuple[int, int]], k: int) -> dict[str, Any]:
    """Acceptance numbers from (accepted, drafted) verify steps."""
    per_pos = [0] * k
    for accepted, _ in steps:
        for i in range(min(accepted, k)):
            per_pos[i] += 1
    return acceptance_block(len(steps), sum(d for _, d in steps), per_pos)


def request_steps(rec: RequestRecord) -> list[tuple[int, int]]:
    return list(zip(rec.steps_accepted or [], rec.steps_drafted or []))


def per_category(records: list[RequestRecord], k: int) -> dict[str, dict]:
    groups: dict[str, list] = collections.defaultdict(list)
    for rec in records:
        groups[rec.category or "uncategorized"] += request_steps(rec)
    out = {}
    for cat in sorted(groups):
        block = steps_block(groups[cat], k)
        block["prompts"] = sum(1 for r in records if (r.category or "uncategorized") == cat)
        out[cat] = block
    return out


def step_span(rec: RequestRecord, end_token_id: int) -> list[str]:
    """The span ('reasoning' | 'answer' | 'no_end_marker') each verify step drafted in.

    The first output token comes from the prefill; step j drafts from output position
    1 + sum_{i<j}(accepted_i + 1) on. A step is attributed to the span of the first token it
    had to guess; the end marker itself counts as reasoning."""
    try:
        end = rec.token_ids.index(end_token_id)
    except ValueError:
        return ["no_end_marker"] * len(rec.steps_accepted or [])
    spans, pos = [], 1
    for accepted in rec.steps_accepted or []:
        spans.append("reasoning" if pos <= end else "answer")
        pos += accepted + 1
    return spans


def per_span(records: list[RequestRecord], k: int, end_token_id: int) -> dict[str, dict]:
    groups: dict[str, list] = {"reasoning": [], "answer": [], "no_end_marker": []}
    counts = collections.Counter()
    for rec in records:
        spans = step_span(rec, end_token_id)
        for span, step in zip(spans, request_steps(rec)):
            groups[span].append(step)
        counts["no_end_marker" if end_token_id not in rec.token_ids else "with_end_marker"] += 1
    out = {span: steps_block(steps, k) for span, steps in groups.items()}
    out["prompts"] = dict(counts)
    return out


def greedy_equality(with_draft: list[RequestRecord], without: list[RequestRecord]) -> dict[str, Any]:
    """Token-by-token comparison of greedy outputs with and without speculation, prompt by prompt
    (matched by id: the untrained baseline may run on a subset)."""
    mismatches = []
    by_id = {r.id: r for r in without}
    pairs = [(a, by_id[a.id]) for a in with_draft if a.id in by_id]
    for a, b in pairs:
        if a.token_ids == b.token_ids:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
        mismatches.append({"id": a.id, "first_mismatch_index": first,
                           "with_draft_tokens": len(a.token_ids), "without_draft_tokens": len(b.token_ids),
                           "with_draft_next": a.token_ids[first:first + 5],
                           "without_draft_next": b.token_ids[first:first + 5]})
    n = len(pairs)
    return {"compared": n, "identical": n - len(mismatches), "mismatches": mismatches,
            "passed": not mismatches}


def request_summaries(records: list[RequestRecord]) -> list[dict]:
    out = []
    for rec in records:
        steps = request_steps(rec)
        accepted = sum(a for a, _ in steps)
        out.append({"id": rec.id, "category": rec.category, "output_tokens": len(rec.token_ids),
                    "finish_reason": rec.finish_reason, "num_drafts": len(steps), "num_accepted_tokens": accepted,
                    "mean_acceptance_length": (1 + accepted / len(steps)) if steps else None,
                    "steps_accepted": rec.steps_accepted})
    return out


def throughput_entry(tokens_with: int, wall_with: float, tokens_without: int, wall_without: float,
                     prompts: int) -> dict[str, Any]:
    with_s = tokens_with / wall_with if wall_with > 0 else None
    without_s = tokens_without / wall_without if wall_without > 0 else None
    return {"prompts": prompts,
            "with_draft": {"output_tokens": tokens_with, "wall_s": round(wall_with, 4), "tokens_per_s": with_s},
            "without_draft": {"output_tokens": tokens_without, "wall_s": round(wall_without, 4),
                              "tokens_per_s": without_s},
            "speedup": (with_s / without_s) if with_s and without_s else None}


@dataclass
class RunResult:
    """One configuration (trained | untrained | no_draft) of one backend."""

    records: list[RequestRecord]
    wall_s: float
    global_block: dict | None = None    # the engine's own counters, when it has them (with "source")
    batched: bool = False               # records came from one concurrent batch (batch throughput)
    concurrency_one: list[RequestRecord] | None = None
    concurrency_one_wall_s: float | None = None
    engine_start_s: float | None = None


def assemble(spec: MeasureSpec, backend: str, runs: dict[str, RunResult], notes: list[str],
             reasoning_marker: str | None) -> dict[str, Any]:
    """The acceptance.json body (minus the header measure_acceptance.py adds)."""
    k = spec.num_speculative_tokens
    acceptance, consistency = {}, {}
    for name in ("trained", "untrained"):
        run = runs[name]
        from_requests = steps_block([s for r in run.records for s in request_steps(r)], k)
        if run.global_block is not None:
            acceptance[name] = dict(run.global_block)
            consistency[name] = {
                key: {"global": run.global_block[key], "sum_of_requests": from_requests[key]}
                for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            consistency[name]["matches"] = all(v["global"] == v["sum_of_requests"]
                                               for v in consistency[name].values())
        else:
            acceptance[name] = dict(from_requests, source=f"{backend}:verify steps")
        acceptance[name]["output_tokens"] = sum(len(r.token_ids) for r in run.records)
        acceptance[name]["prompts"] = len(run.records)

    base = runs["no_draft"]
    throughput: dict[str, Any] = {"batch": None, "concurrency_1": None}
    if runs["trained"].batched and base.batched:
        throughput["batch"] = throughput_entry(
            acceptance["trained"]["output_tokens"], runs["trained"].wall_s,
            sum(len(r.token_ids) for r in base.records), base.wall_s, len(spec.prompts))
        throughput["batch"]["untrained_draft_tokens_per_s"] = (
            acceptance["untrained"]["output_tokens"] / runs["untrained"].wall_s if runs["untrained"].wall_s else None)
    if runs["trained"].concurrency_one and base.concurrency_one:
        c1 = runs["trained"].concurrency_one
        throughput["concurrency_1"] = throughput_entry(
            sum(len(r.token_ids) for r in c1), runs["trained"].concurrency_one_wall_s,
            sum(len(r.token_ids) for r in base.concurrency_one), base.concurrency_one_wall_s, len(c1))
        throughput["concurrency_1"]["mean_acceptance_length"] = steps_block(
            [s for r in c1 for s in request_steps(r)], k)["mean_acceptance_length"]
    # The headline speedup: concurrency 1 where measured (where speculation is meant to pay).
    headline = throughput["concurrency_1"] or throughput["batch"]
    throughput["speedup"] = headline["speedup"] if headline else None
    throughput["speedup_measured_at"] = ("concurrency_1" if throughput["concurrency_1"]
                                         else "batch" if throughput["batch"] else None)

    spans = None
    if spec.reasoning_end_token_id is not None:
        spans = {"end_marker": reasoning_marker, "end_marker_token_id": spec.reasoning_end_token_id,
                 "trained": per_span(runs["trained"].records, k, spec.reasoning_end_token_id),
                 "untrained": per_span(runs["untrained"].records, k, spec.reasoning_end_token_id)}

    return {
        "acceptance": acceptance,
        "consistency": consistency or None,
        "per_category": {name: per_category(runs[name].records, k) for name in ("trained", "untrained")},
        "spans": spans,
        "throughput": throughput,
        "greedy_equality": {name: greedy_equality(runs[name].records, base.records)
                            for name in ("trained", "untrained")},
        "requests": {"trained": request_summaries(runs["trained"].records),
                     "untrained": request_summaries(runs["untrained"].records)},
        "timing": {"engine_start_s": {n: r.engine_start_s for n, r in runs.items() if r.engine_start_s is not None},
                   "generate_wall_s": {n: round(r.wall_s, 4) for n, r in runs.items()}},
        "notes": notes,
    }


class BackendFailure(Exception):
    """The backend could not run a configuration (e.g. vLLM refused the draft). Recorded in
    acceptance.json (the report shows it); not a crash of the measurement script."""

    def __init__(self, run: str, message: str, log_tail: list[str] | None = None):
        super().__init__(message)
        self.run = run
        self.message = message
        self.log_tail = log_tail or []


# ---------------------------------------------------------------------------------------------
# Backend: vLLM (each engine in a child process running measure_acceptance.py --engine-job)

# Lines vLLM prints around a failed start that only point elsewhere ("see root cause above").
_WRAPPER_ERRORS = ("Engine core initialization failed", "WorkerProc initialization failed",
                   "See root cause above", "See stack trace for root cause")
_EXCEPTION_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)(?::\s.*)?)$")


def vllm_root_cause(lines: list[str]) -> str | None:
    """The first exception line after the first traceback in a vLLM log that is not a
    wrapper pointing at another one (vLLM logs benign '...Error: ...' lines at startup)."""
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), 0)
    for line in lines[start:]:
        m = _EXCEPTION_LINE.search(line.rstrip())
        if m and not any(w in line for w in _WRAPPER_ERRORS):
            return m.group(1).strip()
    return None


def answer_room(max_tokens: int, num_speculative_tokens: int) -> int:
    """Context a prompt must leave free: its answer, the draft's lookahead and a small margin."""
    return max_tokens + num_speculative_tokens + 16


def _engine_job(spec: MeasureSpec, draft: str | None, concurrency_one: bool,
                prompts: list[EvalPrompt]) -> dict[str, Any]:
    longest = max(len(p.token_ids) for p in spec.prompts)
    # Room for the longest prompt and its answer; small = small KV cache.
    max_model_len = longest + answer_room(spec.max_tokens, spec.num_speculative_tokens)
    if spec.context_limit:
        max_model_len = min(max_model_len, spec.context_limit)
    return {
        "target": spec.target, "draft": draft, "num_speculative_tokens": spec.num_speculative_tokens,
        "dtype": spec.dtype, "max_tokens": spec.max_tokens, "seed": spec.seed,
        "trust_remote_code": spec.trust_remote_code,
        "max_model_len": max_model_len,
        "prompts": [p.token_ids for p in prompts],
        "concurrency_one": len(spec.concurrency_one) if concurrency_one else 0,
    }


def _run_engine_child(script: str, job: dict, run: str, spec: MeasureSpec) -> dict:
    """Run one engine configuration in a child process; its output goes to our log."""
    with tempfile.TemporaryDirectory(prefix="acceptance-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        cmd = [sys.executable, script, "--engine-job", str(job_path), "--engine-result", str(result_path)]
        spec.log(f"[acceptance] {run}: starting vLLM ({'draft ' + job['draft'] if job['draft'] else 'no speculation'})")
        tail: collections.deque[str] = collections.deque(maxlen=3000)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env={**os.environ, "TMPDIR": tmp})
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:  # interrupted (SIGTERM/SIGINT): let vLLM shut its engine down, then make sure
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        if rc != 0 or not result_path.exists():
            cause = vllm_root_cause(list(tail)) or f"vLLM exited with status {rc} (no exception line in its log)"
            raise BackendFailure(run, cause, list(tail)[-60:])
        return json.loads(result_path.read_text())


def _records_from_engine(outputs: list[dict], prompts: list[EvalPrompt]) -> list[RequestRecord]:
    return [RequestRecord(id=p.id, category=p.category, token_ids=o["token_ids"], finish_reason=o["finish_reason"],
                          steps_accepted=o.get("steps_accepted"), steps_drafted=o.get("steps_drafted"))
            for p, o in zip(prompts, outputs)]


def measure_vllm(spec: MeasureSpec, engine_script: str) -> tuple[dict[str, RunResult], list[str]]:
    runs: dict[str, RunResult] = {}
    # Trained first: if vLLM cannot load the draft we stop there (the others add nothing).
    for run, draft, c1, prompts in (("trained", spec.draft, True, spec.prompts),
                                    ("untrained", spec.untrained, False, spec.untrained_subset),
                                    ("no_draft", None, True, spec.prompts)):
        res = _run_engine_child(engine_script, _engine_job(spec, draft, c1, prompts), run, spec)
        k = spec.num_speculative_tokens
        m = res["batch"]["metrics"]
        block = None
        if draft is not None:
            per_pos = (m["accepted_per_pos"] + [0] * k)[:k]
            block = dict(acceptance_block(m["num_drafts"], m["num_draft_tokens"], per_pos), source="vllm:get_metrics")
        c1_res = res.get("concurrency_one")
        runs[run] = RunResult(
            records=_records_from_engine(res["batch"]["outputs"], prompts), wall_s=res["batch"]["wall_s"],
            global_block=block, batched=True, engine_start_s=res["engine_start_s"],
            concurrency_one=_records_from_engine(c1_res["outputs"], spec.concurrency_one) if c1_res else None,
            concurrency_one_wall_s=c1_res["wall_s"] if c1_res else None)
    notes = ["acceptance numbers are vLLM's spec-decode counters (vllm:spec_decode_*) over the batch run; "
             "categories and spans come from vLLM's per-request detailed metrics "
             "(per_request_spec_decode_metrics=detailed)"]
    return runs, notes


def _metric_snapshot(llm) -> dict[str, Any]:
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
             "vllm:generation_tokens": "generation_tokens"}
    snap: dict[str, Any] = {v: 0 for v in names.values()}
    snap["accepted_per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in names:
            snap[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(metric.values)
            prev = snap["accepted_per_pos"] + [0] * (len(vals) - len(snap["accepted_per_pos"]))
            snap["accepted_per_pos"] = [a + int(b) for a, b in zip(prev, vals)]
    return snap


def _metric_delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in after if k != "accepted_per_pos"}
    b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b)]
    return out


def _engine_outputs(results) -> list[dict]:
    outs = []
    for r in results:
        c = r.outputs[0]
        m = c.spec_decode_metrics
        outs.append({"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                     "steps_accepted": list(m.per_step_accepted) if m is not None else None,
                     "steps_drafted": list(m.per_step_drafted) if m is not None else None})
    return outs


def run_engine_job(job: dict) -> dict:
    """Inside the child: start vLLM once, warm it up, then time the batch run (all prompts at
    once) and the concurrency-1 run (one prompt at a time). Imports vLLM; caller guards main."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from .runtime import has_cuda

    kwargs: dict[str, Any] = dict(
        model=job["target"], tokenizer=job["target"], dtype=job["dtype"], seed=job["seed"],
        max_model_len=job["max_model_len"], disable_log_stats=False,
        trust_remote_code=job["trust_remote_code"],
        # CPU: eager starts in ~15 s instead of ~60 s; GPU: CUDA graphs, as in production.
        enforce_eager=not has_cuda())
    if job["draft"]:
        kwargs["speculative_config"] = {"method": "eagle3", "model": job["draft"],
                                        "num_speculative_tokens": job["num_speculative_tokens"]}
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], seed=job["seed"], detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)

    before = _metric_snapshot(llm)
    t0 = time.perf_counter()
    batch = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {"engine_start_s": round(engine_start_s, 3),
              "batch": {"wall_s": wall, "outputs": _engine_outputs(batch),
                        "metrics": _metric_delta(_metric_snapshot(llm), before)},
              "concurrency_one": None}
    if job["concurrency_one"]:
        outs, wall = [], 0.0
        for p in prompts[: job["concurrency_one"]]:
            t0 = time.perf_counter()
            outs += llm.generate([p], params, use_tqdm=False)
            wall += time.perf_counter() - t0
        result["concurrency_one"] = {"wall_s": wall, "outputs": _engine_outputs(outs)}
    return result


# ---------------------------------------------------------------------------------------------
# Backend: transformers (chain speculation with the target's KV cache)


class _ChainSpeculator:
    """Greedy EAGLE-3 chain speculation, the way vLLM runs it:

    - draft context pair p = (token x_{p+1}, fused target hidden state g_p) at position p+1,
      g_p = fc(concat of the aux-layer hidden states at p);
    - chain step j feeds (drafted token, the draft's own pre-norm output) at the next position;
    - the target verifies [last token, d_1..d_k] in one forward; the longest agreeing prefix is
      accepted plus the target's own next token; rejected KV entries are cropped away and the
      draft's context is extended with the accepted tokens' real target hidden states."""

    def __init__(self, target, draft, k: int, device):
        import torch

        self.torch = torch
        self.target, self.draft, self.k, self.device = target, draft, k, device
        self.aux_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
        d2t = getattr(draft, "d2t", None)
        self.draft_to_target = (torch.arange(d2t.shape[0], device=device) + d2t.to(device)) if d2t is not None else None

    # -- target
    def _target(self, ids, cache):
        out = self.target(input_ids=ids[None], past_key_values=cache, use_cache=True, output_hidden_states=True)
        fused = self.torch.cat([out.hidden_states[i][0] for i in self.aux_ids], dim=-1)
        return out.logits[0].argmax(-1), fused

    # -- draft
    def _fuse(self, aux_hidden):
        """Target aux hidden states -> draft hidden size, with the draft's optional norms."""
        d = self.draft
        if d.input_norm is not None:
            aux_hidden = d.input_norm(aux_hidden)
        if d.fc_norm is not None:
            chunks = aux_hidden.chunk(len(d.fc_norm), dim=-1)
            aux_hidden = self.torch.cat([norm(c) for norm, c in zip(d.fc_norm, chunks)], dim=-1)
        return d.fc(aux_hidden)

    def _draft_forward(self, token_ids, hidden, positions, cache):
        """One draft pass over len(token_ids) new positions appended after the cache."""
        torch, d = self.torch, self.draft
        embeds = d.embed_tokens(token_ids)[None]
        x = torch.cat([embeds, hidden[None]], dim=-1)
        pos = positions[None]
        cos_sin = d.rotary_emb(x, pos)
        past = cache.get_seq_length()
        q, kv = len(token_ids), past + len(token_ids)
        # Causal over (cached context + new positions): new position i sees cache and new <= i.
        mask = torch.ones(q, kv, dtype=torch.bool, device=self.device).tril(diagonal=past)[None, None]
        for layer in d.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                      position_embeddings=cos_sin)
            if isinstance(x, tuple):
                x = x[0]
        if d.config.norm_output:  # Eagle 3.1: the normed state is both read out and fed back
            out = d.norm(x[0])
            logits = d.lm_head(out)
        else:
            out = x[0]
            logits = d.lm_head(d.norm(out))
        ids = logits.argmax(-1)
        if self.draft_to_target is not None:
            ids = self.draft_to_target[ids]
        return out, ids

    @staticmethod
    def _crop(cache, length: int) -> None:
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    def generate(self, prompt: list[int], max_tokens: int, eos: set[int]) -> RequestRecord:
        from transformers import DynamicCache

        torch = self.torch
        tcache, dcache = DynamicCache(), DynamicCache()
        prompt_t = torch.tensor(prompt, device=self.device)
        preds, fused = self._target(prompt_t, tcache)
        tokens = [int(preds[-1])]
        steps_acc, steps_drafted = [], []
        # Draft context for the prompt: pairs (x_{p+1}, g_p), p = 0..n-1, positions 1..n.
        ctx_tokens = torch.cat([prompt_t[1:], preds[-1:]])
        n = len(prompt)
        h, ids = self._draft_forward(ctx_tokens, self._fuse(fused),
                                     torch.arange(1, n + 1, device=self.device), dcache)
        h_last, next_draft = h[-1:], ids[-1:]
        while len(tokens) < max_tokens and tokens[-1] not in eos:
            seq_len = n + len(tokens)          # tokens known so far; the last one is not in tcache yet
            ctx_len = dcache.get_seq_length()  # = seq_len - 1 context pairs
            drafts = [next_draft]
            for j in range(1, self.k):
                h_last, nxt = self._draft_forward(drafts[-1], h_last,
                                                  torch.tensor([seq_len + j - 1], device=self.device), dcache)
                drafts.append(nxt)
            self._crop(dcache, ctx_len)
            drafted = torch.cat(drafts)
            verify_in = torch.cat([torch.tensor([tokens[-1]], device=self.device), drafted])
            preds, fused = self._target(verify_in, tcache)
            accepted = 0
            while accepted < self.k and int(drafted[accepted]) == int(preds[accepted]):
                accepted += 1
            steps_acc.append(accepted)
            steps_drafted.append(self.k)
            new = [int(t) for t in drafted[:accepted]] + [int(preds[accepted])]
            self._crop(tcache, seq_len + accepted)
            for t in new:
                if len(tokens) >= max_tokens or tokens[-1] in eos:
                    break
                tokens.append(t)
            # Extend the draft context with the verified tokens and their target hidden states.
            h, ids = self._draft_forward(torch.tensor(new, device=self.device), self._fuse(fused[: accepted + 1]),
                                         torch.arange(seq_len, seq_len + accepted + 1, device=self.device), dcache)
            h_last, next_draft = h[-1:], ids[-1:]
        finish = "stop" if tokens[-1] in eos else "length"
        return RequestRecord(id="", category=None, token_ids=tokens, finish_reason=finish,
                             steps_accepted=steps_acc, steps_drafted=steps_drafted)


def _greedy_plain(target, prompt: list[int], max_tokens: int, eos: set[int], device) -> RequestRecord:
    """Target-only greedy decoding with a KV cache: the no-speculation baseline."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor(prompt, device=device)
    tokens: list[int] = []
    while len(tokens) < max_tokens and (not tokens or tokens[-1] not in eos):
        out = target(input_ids=ids[None], past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
        ids = torch.tensor([tokens[-1]], device=device)
    return RequestRecord(id="", category=None, token_ids=tokens, finish_reason="stop" if tokens[-1] in eos else "length")


def load_draft_for_transformers(draft_dir: str, target_dir: str, dtype, device):
    """speculators' own loader, with the verifier path pointed at the target we measure
    (checkpoints store it relative to the draft dir; speculators resolves it from the CWD)."""
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(draft_dir)
    config.speculators_config.verifier.name_or_path = str(Path(target_dir).resolve())
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path
    model = SpeculatorModel.from_pretrained(draft_dir, config=config)
    return model.to(device=device, dtype=dtype).eval()


def measure_transformers(spec: MeasureSpec, engine_script: str | None = None) -> tuple[dict[str, RunResult], list[str]]:
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, spec.dtype)
    target = AutoModelForCausalLM.from_pretrained(spec.target, dtype=dtype,
                                                  trust_remote_code=spec.trust_remote_code).to(device).eval()
    eos = set(spec.eos_token_ids)

    def run_all(fn, prompts):
        records, t0 = [], time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                rec = fn(p.token_ids)
                rec.id, rec.category = p.id, p.category
                records.append(rec)
        return records, time.perf_counter() - t0

    # Warm-up (lazy kernels, allocator) so the first timed prompt does not pay for it.
    with torch.inference_mode():
        _greedy_plain(target, spec.prompts[0].token_ids, 4, eos, device)
    runs = {}
    for run, path, prompts in (("trained", spec.draft, spec.prompts),
                               ("untrained", spec.untrained, spec.untrained_subset)):
        spec.log(f"[acceptance] {run}: transformers chain speculation with {path}")
        try:
            draft = load_draft_for_transformers(path, spec.target, dtype, device)
        except Exception as err:  # the draft does not load: recorded like vLLM's refusal
            raise BackendFailure(run, f"{type(err).__name__}: {err}") from None
        chain = _ChainSpeculator(target, draft, spec.num_speculative_tokens, device)
        records, wall = run_all(lambda ids: chain.generate(ids, spec.max_tokens, eos), prompts)
        runs[run] = RunResult(records=records, wall_s=wall)
        if run == "trained":
            c1, c1_wall = run_all(lambda ids: chain.generate(ids, spec.max_tokens, eos), spec.concurrency_one)
            runs[run].concurrency_one, runs[run].concurrency_one_wall_s = c1, c1_wall
        del draft, chain
    spec.log("[acceptance] no_draft: transformers greedy decoding")
    records, wall = run_all(lambda ids: _greedy_plain(target, ids, spec.max_tokens, eos, device), spec.prompts)
    c1, c1_wall = run_all(lambda ids: _greedy_plain(target, ids, spec.max_tokens, eos, device), spec.concurrency_one)
    runs["no_draft"] = RunResult(records=records, wall_s=wall, concurrency_one=c1, concurrency_one_wall_s=c1_wall)
    notes = ["transformers backend: chain speculation, one sequence at a time; the batch throughput is not "
             "measured (no continuous batching), concurrency_1 compares speculative vs plain greedy decoding "
             "in the same Python loop, so it reflects this loop's overheads, not a serving engine's"]
    return runs, notes


# Backends by settings.backend value; each returns ({run name: RunResult}, notes).
BACKENDS: dict[str, Callable[..., tuple[dict[str, RunResult], list[str]]]] = {
    "vllm": measure_vllm,
    "transformers": measure_transformers,
}
