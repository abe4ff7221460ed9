"""Backend `vllm`: real vLLM serves the target with the draft as its EAGLE-3 speculator.

Every engine configuration (trained draft, untrained draft; no speculation in the baseline
job) runs in a child process, one engine at a time (each shut down before the next starts,
vLLM's own error message captured if it cannot load the draft). Where the engine runs in that
process (CPU) one child runs the trained and the untrained draft in turn, so vLLM is imported
once. The speedup rounds need the target alone and the target with the trained draft in turn:
two children that stay up (started one after the other, then used in turn, never decoding at
once: two engines decoding together would time each other), each decoding a round's prompts
when asked; for a target spread over several GPUs, one child at a time on all of them
(speedup.engines_in_turn). Global numbers come from vLLM's spec-decode metrics (`llm.get_metrics()`);
per-request numbers (categories, reasoning/answer spans) from vLLM's per-request detailed
metrics, which list the accepted count of every verify step."""
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
from typing import Any, Callable

from ..draft_types import speculative_config_for
from .inputs import EvalPrompt, MeasureSpec, answer_room
from .records import BackendFailure, RequestRecord, RunResult, acceptance_block, register
from ..parallel import decide
from .speedup import engines_in_turn, run_rounds

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



def _engine_job(spec: MeasureSpec, draft: str | None, prompts: list[EvalPrompt],
                serve: bool = False, in_turn: bool = False) -> dict[str, Any]:
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
        # Speedup rounds: the engine stays up and decodes a round (batch, then one prompt at a
        # time) each time it is asked; where two such engines are up at once, each takes half the memory.
        "serve": {"batch": len(spec.speedup_batch), "concurrency_one": len(spec.concurrency_one),
                  "together": not in_turn} if serve else None,
    }


def _run_engine_child(script: str, runs: list[tuple[str, dict]]) -> list[dict]:
    """Run engine configurations, one after another, in one child process; its output goes to
    our log. One result per run; the run that fails raises BackendFailure naming it (the runs
    after it do not start)."""
    with tempfile.TemporaryDirectory(prefix="acceptance-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({"sequence": [{**job, "run": run} for run, job in runs]}))
        cmd = [sys.executable, script, "--engine-job", str(job_path), "--engine-result", str(result_path)]
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
        results = []
        for i in range(len(runs)):
            path = sequence_result(result_path, i)
            if not path.exists():
                break
            results.append(json.loads(path.read_text()))
        if rc != 0 or len(results) < len(runs):
            cause = vllm_root_cause(list(tail)) or f"vLLM exited with status {rc} (no exception line in its log)"
            raise BackendFailure(runs[len(results)][0] if len(results) < len(runs) else runs[-1][0],
                                 cause, list(tail)[-60:])
        return results


def sequence_result(result_path: str | Path, i: int) -> Path:
    return Path(f"{result_path}.{i}")


def _records_from_engine(outputs: list[dict], prompts: list[EvalPrompt]) -> list[RequestRecord]:
    return [RequestRecord(id=p.id, category=p.category, token_ids=o["token_ids"], finish_reason=o["finish_reason"],
                          steps_accepted=o.get("steps_accepted"), steps_drafted=o.get("steps_drafted"))
            for p, o in zip(prompts, outputs)]


def _engine_runs(spec: MeasureSpec, engine_script: str,
                 runs: list[tuple[str, str | None, list[EvalPrompt]]]) -> dict[str, RunResult]:
    """(name, draft or None, prompts) per run, measured in this order. With the engine in the
    child's own process (CPU) one child runs them all: each further child would import vLLM
    again (7 s on a 2-core CPU machine, 2026-12-06) for an engine that starts in 3. Where the
    engine is a process of its own (GPU), a child each, so each starts on a clean device."""
    from ..runtime import vllm_engine_in_process

    decide().apply()  # the children's layout (they decide alike), here for this job's provenance
    jobs = [(run, _engine_job(spec, draft, prompts)) for run, draft, prompts in runs]
    groups = [jobs] if vllm_engine_in_process() else [[job] for job in jobs]  # decided here; children inherit it
    results = [res for group in groups for res in _run_engine_child(engine_script, group)]
    k = spec.num_speculative_tokens
    out = {}
    for (run, draft, prompts), res in zip(runs, results):
        m = res["batch"]["metrics"]
        block = None
        if draft is not None:
            per_pos = (m["accepted_per_pos"] + [0] * k)[:k]
            block = dict(acceptance_block(m["num_drafts"], m["num_draft_tokens"], per_pos), source="vllm:get_metrics")
        out[run] = RunResult(records=_records_from_engine(res["batch"]["outputs"], prompts),
                             wall_s=res["batch"]["wall_s"], global_block=block, batched=True,
                             engine_start_s=res["engine_start_s"], per_request_source=res.get("per_request_source"))
    return out


@register("vllm", "no_draft")
def measure_vllm_no_draft(spec: MeasureSpec, engine_script: str) -> tuple[RunResult, list[str]]:
    """The target alone, all prompts at once: the greedy outputs speculation must reproduce."""
    return _engine_runs(spec, engine_script, [("no_draft", None, spec.prompts)])["no_draft"], []


@register("vllm", "drafts")
def measure_vllm(spec: MeasureSpec, engine_script: str) -> tuple[dict[str, RunResult], list[str]]:
    # Trained first: if vLLM cannot load the draft we stop there (the untrained one adds nothing).
    runs = _engine_runs(spec, engine_script, [("trained", spec.draft, spec.prompts),
                                              ("untrained", spec.untrained, spec.untrained_subset)])
    per_request = ("vLLM's per-request detailed metrics (per_request_spec_decode_metrics=detailed)"
                   if not runs["trained"].per_request_source else runs["trained"].per_request_source)
    notes = ["acceptance numbers are vLLM's spec-decode counters (vllm:spec_decode_*) over the batch run; "
             f"categories and spans come from {per_request}"]
    return runs, notes


class _ServedEngine:
    """One engine child that stays up for the speedup rounds: start() returns once its engine
    is up and warm; round() asks it for one round and waits for the result file."""

    def __init__(self, script: str, job: dict, run: str, spec: MeasureSpec, tmp: Path):
        self.run, self.spec = run, spec
        self.dir = Path(tempfile.mkdtemp(prefix=f"{run}-", dir=tmp))  # an arm started again gets a new one
        job = {**job, "ready_file": str(self.dir / "ready.json")}
        (self.dir / "job.json").write_text(json.dumps(job))
        self.log_path = self.dir / "engine.log"
        self.log = open(self.log_path, "w")
        spec.log(f"[speedup] {run}: starting vLLM ({'draft ' + job['draft'] if job['draft'] else 'no speculation'})")
        self.proc = subprocess.Popen(
            [sys.executable, script, "--engine-job", str(self.dir / "job.json"),
             "--engine-result", str(self.dir / "result.json")],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TMPDIR": str(self.dir)})
        self.rounds = 0
        self.ready = self._wait(self.dir / "ready.json")

    def _wait(self, path: Path) -> dict:
        while not path.exists():
            if self.proc.poll() is not None:
                lines = self.log_path.read_text(errors="replace").splitlines()
                cause = vllm_root_cause(lines) or f"vLLM exited with status {self.proc.returncode}"
                raise BackendFailure(f"speedup:{self.run}", cause, lines[-60:])
            time.sleep(0.05)
        return json.loads(path.read_text())

    def round(self) -> dict:
        self.rounds += 1
        out = self.dir / f"round-{self.rounds}.json"
        self.proc.stdin.write(json.dumps({"out": str(out)}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._wait(out)

    def close(self) -> None:
        """EOF on its stdin ends the child's loop (its engine shuts down); its log goes to ours."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=60)
        except BaseException:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        finally:
            self.log.close()
            sys.stderr.write(self.log_path.read_text(errors="replace"))


def _rss_mb(pid: int) -> float | None:
    """Resident memory of a process and its children (an engine core of its own on GPU)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return round(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20, 1)
    except Exception:
        return None


class _EnginesInTurn:
    """One engine up at a time, on all the job's GPUs: asked for the other arm, it stops the one
    that is up and starts the other, warmed up by an untimed round. Rounds alternate their order
    (without, with; with, without; ...), so the arm that ends a round begins the next on the same
    engine: rounds + 1 starts, not 2 x rounds."""

    def __init__(self, start: Callable[[str], _ServedEngine]):
        self.start, self.up = start, None
        self.starts: list[dict] = []

    def arm(self, run: str) -> Callable[[], dict]:
        return lambda: self.round(run)

    def round(self, run: str) -> dict:
        if self.up is None or self.up.run != run:
            self.close()
            self.up = self.start(run)
            self.starts.append({"arm": run, "engine_start_s": self.up.ready["engine_start_s"]})
            self.up.round()  # untimed: an engine's first pass over a batch shape is slower (run_rounds)
        return self.up.round()

    def close(self) -> None:
        if self.up is not None:
            self.up.close()
            self.up = None


@register("vllm", "speedup")
def measure_vllm_speedup(spec: MeasureSpec, engine_script: str) -> tuple[list[dict], dict]:
    """Interleaved rounds: the target alone and the target with the trained draft; per round and
    arm, the batch and the concurrency-1 timings (and, with the draft, its accepted / drafted
    counts: the tau bound of those prompts). Both engines started once and kept up, or, for a
    target over several GPUs, one at a time (_EnginesInTurn)."""
    in_turn = engines_in_turn(spec.speedup_engines, decide().ranks)
    drafts = {"without_draft": None, "with_draft": spec.draft}
    prompts = spec.prompts[: max(len(spec.speedup_batch), len(spec.concurrency_one))]
    with tempfile.TemporaryDirectory(prefix="speedup-") as tmp:
        def start(arm: str) -> _ServedEngine:
            return _ServedEngine(engine_script, _engine_job(spec, drafts[arm], prompts, serve=True, in_turn=in_turn),
                                 arm, spec, Path(tmp))

        if in_turn:
            engines = _EnginesInTurn(start)
            try:
                rounds = run_rounds({arm: engines.arm(arm) for arm in drafts}, spec.speedup_rounds, spec.log,
                                    warm_up=False)
            finally:
                engines.close()
            return rounds, {"engines": "in_turn", "starts": engines.starts}
        served: dict[str, _ServedEngine] = {}
        try:
            for arm in drafts:
                served[arm] = start(arm)
            cost = {arm: {"engine_start_s": e.ready["engine_start_s"], "rss_mb": _rss_mb(e.proc.pid)}
                    for arm, e in served.items()}
            spec.log(f"[speedup] both engines up: {cost}")
            rounds = run_rounds({arm: e.round for arm, e in served.items()}, spec.speedup_rounds, spec.log)
        finally:
            for e in served.values():
                e.close()
    return rounds, {"engines": "together", **cost}


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
        m = getattr(c, "spec_decode_metrics", None)
        outs.append({"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                     "steps_accepted": list(m.per_step_accepted) if m is not None else None,
                     "steps_drafted": list(m.per_step_drafted) if m is not None else None})
    return outs


def _engine_accepts(name: str) -> bool:
    """Whether this vLLM's engine arguments have `name` (they differ between releases)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return name in {f.name for f in dataclasses.fields(EngineArgs)}


def run_engine_jobs(jobs: dict, result_path: str) -> None:
    """Inside the child: one engine job (`--engine-result` gets its result), or a sequence of them
    run in turn (result i in `<result>.i`), each engine shut down before the next one starts."""
    from ..io import atomic_write_json

    if "sequence" not in jobs:
        atomic_write_json(result_path, run_engine_job(jobs))
        return
    for i, job in enumerate(jobs["sequence"]):
        if i:
            _shut_down_engines()
        what = f"draft {job['draft']}" if job["draft"] else "no speculation"
        print(f"[acceptance] {job['run']}: starting vLLM ({what})", file=sys.stderr, flush=True)
        atomic_write_json(sequence_result(result_path, i), run_engine_job(job))


def _shut_down_engines() -> None:
    """Free the last engine (collected once unreferenced) and vLLM's process-wide distributed
    state, which a second engine in the same process would otherwise find initialised."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def run_engine_job(job: dict) -> dict:
    """Inside the child: start vLLM once, warm it up, then time the batch run (all prompts at
    once) and the concurrency-1 run (one prompt at a time). Imports vLLM; caller guards main."""
    from ..runtime import vllm_engine_in_process

    vllm_engine_in_process()  # the parent's choice, inherited; decides only when run by hand
    layout = decide().apply()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=job["target"], tokenizer=job["target"], dtype=job["dtype"], seed=job["seed"],
        max_model_len=job["max_model_len"], disable_log_stats=False,
        trust_remote_code=job["trust_remote_code"],
        # CPU: eager starts in ~15 s instead of ~60 s; GPU: CUDA graphs, as in production.
        enforce_eager=not layout.gpus, **layout.engine_kwargs())
    if job["draft"]:
        # The method the draft's own type runs as (eagle3, P-EAGLE's parallel eagle3, dflash, ...).
        kwargs["speculative_config"] = speculative_config_for(job["draft"], job["num_speculative_tokens"])
        if _engine_accepts("per_request_spec_decode_metrics"):  # not in vLLM 0.26: global counters only
            kwargs["per_request_spec_decode_metrics"] = "detailed"
    if job["serve"] and job["serve"]["together"] and layout.gpus:  # two engines share the GPUs: each its half
        kwargs["gpu_memory_utilization"] = 0.45  # (vLLM's default 0.9)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], seed=job["seed"], detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)

    if job["serve"]:
        return serve_rounds(llm, job, prompts, params, engine_start_s)
    before = _metric_snapshot(llm)
    t0 = time.perf_counter()
    batch = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {"engine_start_s": round(engine_start_s, 3),
              "batch": {"wall_s": wall, "outputs": _engine_outputs(batch),
                        "metrics": _metric_delta(_metric_snapshot(llm), before)}}
    if job["draft"] and "per_request_spec_decode_metrics" not in kwargs:
        result["per_request_source"] = _steps_from_counters(llm, prompts, params, result["batch"]["outputs"])
    return result


def _steps_from_counters(llm, prompts, params, outputs: list[dict]) -> str:
    """A vLLM without per-request spec-decode metrics (0.26): decode each prompt alone and take
    the deltas of the engine's global counters. A request's verify steps are then known as a count
    per accepted length (from the per-position counters), not in their order: enough for tau per
    prompt, category and suite, not for reasoning/answer spans. Fills each output's steps."""
    for prompt, out in zip(prompts, outputs):
        before = _metric_snapshot(llm)
        [alone] = llm.generate([prompt], params, use_tqdm=False)
        d = _metric_delta(_metric_snapshot(llm), before)
        out["alone_matches_batch"] = list(alone.outputs[0].token_ids) == out["token_ids"]
        n, per_pos = int(d["num_drafts"]), [int(x) for x in d["accepted_per_pos"]]
        # steps accepting exactly j tokens: those accepting >= j minus those accepting >= j + 1
        at_least = [n] + per_pos + [0]
        out["steps_accepted"] = [j for j in range(len(at_least) - 1) for _ in range(at_least[j] - at_least[j + 1])]
        out["steps_drafted"] = [round(d["num_draft_tokens"] / n)] * n if n else []
    return "global counters, each prompt decoded alone (steps as counts per accepted length, order unknown)"


def _timed(llm, prompts, params, one_at_a_time: bool) -> dict:
    """Output tokens and decode seconds of these prompts (and, with a draft, the verify steps'
    accepted and drafted counts)."""
    outs, wall = [], 0.0
    for group in ([[p] for p in prompts] if one_at_a_time else [prompts]):
        t0 = time.perf_counter()
        outs += llm.generate(group, params, use_tqdm=False)
        wall += time.perf_counter() - t0
    rows = _engine_outputs(outs)
    steps = [n for r in rows for n in (r["steps_accepted"] or [])]
    return {"output_tokens": sum(len(r["token_ids"]) for r in rows), "wall_s": wall,
            "accepted": sum(steps), "drafts": len(steps)}


def serve_rounds(llm, job: dict, prompts: list, params, engine_start_s: float) -> dict:
    """Inside a speedup child: say ready, then decode one round per line on stdin (its result
    written atomically where the line says) until stdin closes."""
    from ..io import atomic_write_json

    atomic_write_json(job["ready_file"], {"engine_start_s": round(engine_start_s, 3)})
    done = 0
    for line in sys.stdin:
        atomic_write_json(json.loads(line)["out"], {
            "batch": _timed(llm, prompts[: job["serve"]["batch"]], params, False),
            "concurrency_1": _timed(llm, prompts[: job["serve"]["concurrency_one"]], params, True)
            if job["serve"]["concurrency_one"] else None})
        done += 1
    return {"engine_start_s": round(engine_start_s, 3), "rounds": done}
