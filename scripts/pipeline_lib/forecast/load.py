"""One point of a curve: GuideLLM's closed-loop streams against a server for a window, with the
server's speculative-decoding counters read before and after, and the checks that keep a point
that lies out of a table (failed requests, too few requests, no latency measured)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..hidden_states.server import stop_group
from .server import PER_POSITION, SPEC_COUNTERS

# GuideLLM's own start (imports, tokenizer, dataset), after which a run whose window has not
# begun is taken as hung. GuideLLM can also stall after a window with every request answered (its
# main process waiting on a worker message that never comes; reported upstream as
# https://github.com/vllm-project/guidellm/issues/431 and /issues/1152): in the draft arm of about
# one CPU forecast test in four or five (2026-12-06/07). So once its log says the window began,
# the run gets the window and GUIDELLM_FINISH_S to exit: a stall costs that, not the start
# allowance on top.
GUIDELLM_START_S = 120.0
GUIDELLM_WINDOW_STARTED = "Starting benchmark for strategy"
GUIDELLM_FINISH_S = 30.0  # after its window; 7 s on a 2-core CPU for 5 s windows (0.3 s past it)
GUIDELLM_ATTEMPTS = 2


def guidellm_point(url: str, streams: int, data: Path, tokenizer: Path, max_tokens: int, seconds: float,
                   warmup: float, out: Path, log: Path) -> dict:
    """One GuideLLM run: `streams` closed-loop streaming chat requests for `seconds`, the first
    and last `warmup` of it not counted. Returns GuideLLM's benchmark record."""
    backend = {"kind": "openai_http", "target": url, "request_format": "/v1/chat/completions",
               "model": "target", "max_tokens": max_tokens}
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend", json.dumps(backend),
           "--profile", f"kind=concurrent,streams={streams},warmup={warmup},cooldown={warmup}",
           "--constraint", f"kind=max_duration,seconds={seconds}",
           "--constraint", "kind=max_errors,count=5",
           "--data", f"kind=json_file,path={data}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    rc = run_watched(cmd, log, out, seconds + GUIDELLM_START_S, GUIDELLM_ATTEMPTS,
                     env={**os.environ, "HF_HUB_OFFLINE": "1"},
                     started=(GUIDELLM_WINDOW_STARTED, seconds + GUIDELLM_FINISH_S))
    if rc != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {rc} at {streams} streams; see {log}")
    return json.loads(out.read_text())["benchmarks"][0]


def run_watched(cmd: list[str], log: Path, out: Path, limit_s: float, attempts: int,
                env: dict[str, str] | None = None, started: tuple[str, float] | None = None) -> int:
    """Run `cmd` (its output appended to `log`) in a process group of its own; one that has not
    exited after `limit_s` is stopped as a group (its forked workers too) and run again, up to
    `attempts` times. `started` = (marker, seconds): once the attempt's output has a line with
    `marker`, it must exit within `seconds` of it, whatever is left of `limit_s`. Returns the
    exit status of the run that ended; raises RuntimeError naming the log when every attempt
    hung. `out` is removed before each attempt, so a file left by a stopped run is never read
    as a result."""
    for attempt in range(1, attempts + 1):
        out.unlink(missing_ok=True)
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            offset = f.tell()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            begun = time.monotonic()
            deadline, why, watch = begun + limit_s, f"no exit after {limit_s:.0f} s", started
            try:
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        return proc.wait(timeout=min(0.5, left))
                    except subprocess.TimeoutExpired:
                        pass
                    if watch and watch[0] in _read_from(log, offset):
                        now = time.monotonic()
                        deadline = min(deadline, now + watch[1])
                        why = f"no exit {watch[1]:.0f} s after its '{watch[0]}' line ({now - begun:.0f} s in)"
                        watch = None
            except BaseException:  # the job itself is stopped: its GuideLLM goes with it
                stop_group(proc.pid, grace_s=10, leader=proc)
                raise
            stop_group(proc.pid, grace_s=10, leader=proc)
            f.write(f"[watchdog] {why} (attempt {attempt} of {attempts}): process group stopped\n")
    raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])}: none of {attempts} attempts exited (the last: {why}; "
                       f"stopped each time); see {log}")


def _read_from(path: Path, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def point_figures(bench: dict, before: dict, after: dict) -> dict:
    """The figures of one point from GuideLLM's record and the server's counter deltas."""
    m = bench["metrics"]
    totals = m["request_totals"]
    drafts = after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]]
    accepted = after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]]
    itl = m["inter_token_latency_ms"]["successful"]["mean"]
    pos_after, pos_before = after.get(PER_POSITION) or {}, before.get(PER_POSITION) or {}
    per_pos = [pos_after[i] - pos_before.get(i, 0.0) for i in sorted(pos_after)]
    return {
        "requests_ok": totals["successful"], "requests_errored": totals["errored"],
        "requests_incomplete": totals["incomplete"],
        "window_s": round(bench["duration"] - bench.get("warmup_duration", 0) - bench.get("cooldown_duration", 0), 2),
        "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
        "itl_ms": itl,
        "tok_s_per_user": 1000.0 / itl if itl else None,
        "ttft_ms": m["time_to_first_token_ms"]["successful"]["median"],
        "output_tokens_per_request": m["output_token_count"]["successful"]["mean"],
        "tau": 1 + accepted / drafts if drafts else None,
        "drafts": drafts,
        # P(the first i+1 draft tokens all accepted), per position i: vLLM's synthetic_acceptance_rates
        "acceptance_rates": [a / drafts for a in per_pos] if drafts and per_pos else None,
        "guidellm_warnings": [w.get("message") for w in bench.get("warnings") or []],
    }


def check_point(p: dict, min_requests: int) -> str | None:
    """Why a point is not to be trusted, or None."""
    if p["requests_errored"]:
        return f"{p['requests_errored']} requests failed"
    if p["requests_ok"] < min_requests:
        return f"only {p['requests_ok']} requests completed in the window (need {min_requests})"
    if not p["tok_s_per_user"]:
        return "no inter-token latency measured"
    return None


def prompts_file(turns: list[str], path: Path, repeat: int = 64, output_tokens: int | None = None) -> Path:
    """GuideLLM's data file: the same prompts for every arm, repeated so that no point runs out
    of them (128 streams finish 80 MT-Bench prompts within a second on a GPU). `output_tokens`:
    every answer exactly that long (GuideLLM then asks with ignore_eos), whatever the weights."""
    extra = {} if output_tokens is None else {"output_tokens_count": int(output_tokens)}
    path.write_text(json.dumps([{"prompt": t, **extra} for _ in range(repeat) for t in turns]))
    return path
