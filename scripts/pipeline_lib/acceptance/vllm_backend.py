"""Backend `vllm`: real vLLM serves the target with the draft as its EAGLE-3 speculator.

Every engine configuration (trained draft, untrained draft; no speculation in the baseline
job) runs in its own child process (one engine at a time, memory returned between them, vLLM's own error message
captured if it cannot load the draft). Global numbers come from vLLM's spec-decode metrics
(`llm.get_metrics()`); per-request numbers (categories, reasoning/answer spans) from vLLM's
per-request detailed metrics, which list the accepted count of every verify step."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .inputs import EvalPrompt, MeasureSpec, answer_room
from .records import BackendFailure, RequestRecord, RunResult, acceptance_block, register

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
    from ..runtime import vllm_engine_in_process

    vllm_engine_in_process()  # decided here, once: the child inherits it (and provenance records it)
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


def _engine_run(spec: MeasureSpec, engine_script: str, run: str, draft: str | None, concurrency_one: bool,
                prompts: list[EvalPrompt]) -> RunResult:
    res = _run_engine_child(engine_script, _engine_job(spec, draft, concurrency_one, prompts), run, spec)
    k = spec.num_speculative_tokens
    m = res["batch"]["metrics"]
    block = None
    if draft is not None:
        per_pos = (m["accepted_per_pos"] + [0] * k)[:k]
        block = dict(acceptance_block(m["num_drafts"], m["num_draft_tokens"], per_pos), source="vllm:get_metrics")
    c1_res = res.get("concurrency_one")
    return RunResult(
        records=_records_from_engine(res["batch"]["outputs"], prompts), wall_s=res["batch"]["wall_s"],
        global_block=block, batched=True, engine_start_s=res["engine_start_s"],
        concurrency_one=_records_from_engine(c1_res["outputs"], spec.concurrency_one) if c1_res else None,
        concurrency_one_wall_s=c1_res["wall_s"] if c1_res else None)


@register("vllm", "no_draft")
def measure_vllm_no_draft(spec: MeasureSpec, engine_script: str) -> tuple[RunResult, list[str]]:
    """The target alone: the batch run and the concurrency-1 run."""
    return _engine_run(spec, engine_script, "no_draft", None, True, spec.prompts), []


@register("vllm", "drafts")
def measure_vllm(spec: MeasureSpec, engine_script: str) -> tuple[dict[str, RunResult], list[str]]:
    # Trained first: if vLLM cannot load the draft we stop there (the untrained one adds nothing).
    runs = {"trained": _engine_run(spec, engine_script, "trained", spec.draft, True, spec.prompts),
            "untrained": _engine_run(spec, engine_script, "untrained", spec.untrained, False, spec.untrained_subset)}
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
    from ..runtime import has_cuda, vllm_engine_in_process

    vllm_engine_in_process()  # the parent's choice, inherited; decides only when run by hand
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
