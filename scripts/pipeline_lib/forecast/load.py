"""One point of a curve: GuideLLM's closed-loop streams against a server for a window, with the
server's speculative-decoding counters read before and after, and the checks that keep a point
that lies out of a table (failed requests, too few requests, no latency measured)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .server import SPEC_COUNTERS


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
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    if rc != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {rc} at {streams} streams; see {log}")
    return json.loads(out.read_text())["benchmarks"][0]


def point_figures(bench: dict, before: dict, after: dict) -> dict:
    """The figures of one point from GuideLLM's record and the server's counter deltas."""
    m = bench["metrics"]
    totals = m["request_totals"]
    drafts = after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]]
    accepted = after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]]
    itl = m["inter_token_latency_ms"]["successful"]["mean"]
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


def prompts_file(turns: list[str], path: Path, repeat: int = 64) -> Path:
    """GuideLLM's data file: the same prompts for every arm, repeated so that no point runs out
    of them (128 streams finish 80 MT-Bench prompts within a second on a GPU)."""
    path.write_text(json.dumps([{"prompt": t} for _ in range(repeat) for t in turns]))
    return path
