"""Where training reads its hidden states from (`hidden_states.mode`), one class per mode:

- `offline`: the files the hidden_states rules wrote (speculators' data dir + manifest.json),
  in their storage format; speculators reads them through its `file` or `fp8` transfer and
  treats a missing file as an error (`--on-missing raise`).
- `online`: a vLLM server started by the training job itself (server.py) extracts each
  sample's hidden states when the trainer asks (`--on-missing generate`); the trainer reads
  them through the transfer of the storage format and deletes them after use.

A source describes the hidden states the way the offline manifest does (aux layer ids, final
layer, hidden size, target digest, rows), so train_draft.py checks both modes the same way,
gives speculators its data flags, and writes the record (drafts/<v>/hidden_states.json) the
contract checks compare the draft against."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import PipelineError
from ..io import read_json
from ..target import loaded_weights_digest
from .formats import storage_format
from .server import HiddenStatesServer, JobStopped, ServerDied, ServerSettings, StopOnSignals, split_devices
from .store import layer_spec

ONLINE_WORK_DIR = "online-server"   # under the checkpoints dir: server log, pid file, in-flight files


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (tensor names, dtypes, shapes) without the data."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError("header larger than 100 MiB")
            return json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as err:
        raise PipelineError(f"{path}: not a readable safetensors file ({err}); re-run the "
                            f"hidden_states stage for this row") from None


def source_fingerprint(mode: str, storage: str) -> dict[str, Any]:
    """What, besides the data digest, makes another run's checkpoints unusable for a resume
    (train_draft's trajectory fingerprint): how the hidden states were stored and served.
    Empty for offline bf16, so checkpoints made before modes and formats existed still resume."""
    return {} if (mode, storage) == ("offline", "bf16") else {"hidden_states": {"mode": mode, "storage": storage}}


class OfflineSource:
    mode = "offline"

    def __init__(self, args, settings: dict[str, Any]):
        if not args.hs_manifest:
            raise PipelineError("offline training (hidden_states.mode: offline) needs --hs-manifest")
        self.manifest_path = Path(args.hs_manifest)
        self.data = Path(args.data)
        self.manifest: dict[str, Any] = {}

    @property
    def where(self) -> str:
        return str(self.manifest_path)

    @property
    def storage(self) -> str:
        return self.manifest.get("storage", "bf16")  # manifests older than storage formats are bf16

    def describe(self, target_dir: Path, target_manifest: dict) -> dict[str, Any]:
        self.manifest = read_json(self.manifest_path, "hidden-states manifest")
        for key in ("aux_layer_ids", "final_layer_id", "hidden_size", "target_digest", "rows", "files"):
            if key not in self.manifest:
                raise PipelineError(f"{self.manifest_path}: key '{key}' is missing; re-run the hidden_states stage")
        storage_format(self.storage)  # an unknown format fails here, naming it
        return self.manifest

    def check_files(self, hs: dict, seq_lens: list[int], n_layers: int, hidden: int) -> None:
        rows = len(seq_lens)
        expected = {f"hs_{i}.safetensors" for i in range(rows)}
        listed = set(hs["files"])
        if listed != expected:
            missing, extra = sorted(expected - listed)[:3], sorted(listed - expected)[:3]
            raise PipelineError(f"{self.where}: 'files' lists {len(listed)} hidden-state files for {rows} rows "
                                f"(missing e.g. {missing}, unexpected e.g. {extra}); re-run the hidden_states stage")
        hs_dir = self.data / "hidden_states"
        present = {p.name for p in hs_dir.glob("hs_*.safetensors")} if hs_dir.is_dir() else set()
        if present != expected:
            missing = sorted(expected - present, key=lambda n: int(n[3:-12]))[:3]
            extra = sorted(present - expected)[:3]
            raise PipelineError(f"{hs_dir}: {len(present)} hidden-state files for {rows} rows (missing e.g. "
                                f"{missing}, unexpected e.g. {extra}); re-run the hidden_states stage")
        fmt, dtype = storage_format(self.storage), hs.get("dtype", "bfloat16")
        for i, seq_len in enumerate(seq_lens):
            path = hs_dir / f"hs_{i}.safetensors"
            problem = fmt.header_problem(read_safetensors_header(path), seq_len, [seq_len, n_layers, hidden], dtype)
            if problem:
                raise PipelineError(
                    f"{path}: {problem}; row {i} needs {seq_len} tokens x {n_layers} layers (aux_layer_ids "
                    f"{hs['aux_layer_ids']} + the final layer, per {self.where}) in storage {fmt.name}; the "
                    f"files were extracted with other layers or another format: re-run the hidden_states stage")

    def fingerprint(self) -> dict[str, Any]:
        return source_fingerprint(self.mode, self.storage)

    def claim_devices(self, gpus: int) -> int:
        """GPUs the trainer gets (all of the job's)."""
        return gpus

    @contextlib.contextmanager
    def serving(self, log: Callable[[str], None]) -> Iterator[list[str]]:
        """speculators' data flags while training runs (nothing to start offline)."""
        yield ["--hidden-states-backend", storage_format(self.storage).transfer_backend,
               # A missing hidden-state file is an error here, never a call to a vLLM server.
               "--on-missing", "raise"]

    def record(self) -> dict[str, Any]:
        keys = ("aux_layer_ids", "final_layer_id", "hidden_size", "dtype", "stored_dtype", "target_digest",
                "data_digest", "rows", "tokens", "bytes", "bytes_per_token")
        return {"mode": self.mode, "storage": self.storage,
                "transfer": storage_format(self.storage).transfer_backend, "manifest": str(self.manifest_path),
                **{k: self.manifest.get(k) for k in keys}}


class OnlineSource:
    mode = "online"

    def __init__(self, args, settings: dict[str, Any]):
        if args.nodes > 1:
            raise PipelineError(f"hidden_states.mode: online trains on one node (the server listens on "
                                f"127.0.0.1); resources.train.nodes = {args.nodes}: set it to 1, or use offline mode")
        self.settings = settings
        self.target, self.data = Path(args.target), Path(args.data)
        self.target_manifest_path = Path(args.target_manifest)
        self.work_dir = Path(args.checkpoints) / ONLINE_WORK_DIR
        self.spec = None
        self.manifest: dict[str, Any] = {}
        self.server_info: dict[str, Any] = {}
        # The job's GPUs (from run_on_gpus.py or SLURM): the first server_gpus go to the server.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(args.gpus)]
        self.server_devices, self.trainer_devices = split_devices(ids, int(settings.get("server_gpus", 0)), args.gpus)

    @property
    def where(self) -> str:
        return "hidden_states settings (online)"

    @property
    def storage(self) -> str:
        return self.spec.storage

    def claim_devices(self, gpus: int) -> int:
        """Narrow this process (the trainer) to its share of the job's GPUs; returns how many.
        Called before torch initializes CUDA."""
        if gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.trainer_devices)
        return len(self.trainer_devices)

    def describe(self, target_dir: Path, target_manifest: dict) -> dict[str, Any]:
        from datasets import load_from_disk

        from ..provenance import upstream_digest

        # The server's files are read once and deleted: in the dtype it computes in.
        self.spec = layer_spec(target_dir, self.settings, files_as_computed=True)
        try:
            rows = len(load_from_disk(str(self.data)))
        except Exception as err:  # datasets raises several types for a non-dataset dir
            raise PipelineError(f"{self.data}: not a datasets save_to_disk dir ({err}); re-run the tokenize "
                                f"stage") from None
        self.manifest = {
            "aux_layer_ids": list(self.spec.aux_layer_ids), "final_layer_id": self.spec.final_layer_id,
            "hidden_size": self.spec.hidden_size, "dtype": self.spec.dtype,
            "stored_dtype": self.spec.format.stored_dtype(self.spec.dtype),
            # the weight files the server will load, hashed here (as an offline shard does)
            "target_digest": loaded_weights_digest(self.target, self.target_manifest_path),
            "data_digest": upstream_digest(self.data),
            "rows": rows,
        }
        return self.manifest

    def check_files(self, hs: dict, seq_lens: list[int], n_layers: int, hidden: int) -> None:
        self.manifest["tokens"] = sum(seq_lens)
        self.max_len = max(seq_lens)
        if self.spec.max_positions and self.max_len + 1 > self.spec.max_positions:
            raise PipelineError(
                f"{self.data}: the longest row has {self.max_len} tokens; the vLLM server needs one position "
                f"more but the target allows {self.spec.max_positions}; lower tokenize.max_seq_len")

    def fingerprint(self) -> dict[str, Any]:
        return source_fingerprint(self.mode, self.storage)

    @contextlib.contextmanager
    def serving(self, log: Callable[[str], None]) -> Iterator[list[str]]:
        """Start the server, check it with one probe request, watch it; yield speculators' data
        flags; stop it and remove every in-flight file on the way out, however training ends."""
        from datasets import load_from_disk

        first_row = list(load_from_disk(str(self.data)).with_format(None)[0]["input_ids"])
        for name in ("httpx", "httpx2"):  # one INFO line per sample request would flood the job log
            logging.getLogger(name).setLevel(logging.WARNING)
        s = self.settings
        server = HiddenStatesServer(
            self.target, self.spec, self.work_dir, self.max_len + 1,
            ServerSettings(start_timeout_s=float(s.get("server_start_timeout_s", 1800)),
                           request_timeout_s=float(s.get("request_timeout_s", 120)),
                           devices=tuple(self.server_devices),
                           trust_remote_code=bool(s.get("trust_remote_code", False))),
            log=log)
        try:
            with StopOnSignals() as signals, speculators_graceful_shutdown_off(), server:
                self.server_info = {"command": server.command(server.port), "devices": self.server_devices,
                                    "trainer_devices": self.trainer_devices, "layer_ids": self.spec.layer_ids,
                                    "log": str(server.log_path), "pgid": server.proc.pid}
                self.server_info["probe"] = server.probe(first_row)
                log(f"probe request: {self.server_info['probe']}")
                server.watch(lambda: signals.interrupt(ServerDied(server.death_message())))
                yield ["--hidden-states-backend", self.spec.format.transfer_backend,
                       "--hidden-states-path", str(server.hs_dir.resolve()),
                       "--vllm-endpoint", server.endpoint, "--on-missing", "generate",
                       "--request-timeout", str(server.settings.request_timeout_s), "--max-retries", "1"]
        except JobStopped as stop:
            raise PipelineError(str(stop)) from None
        finally:
            self.server_info["files_left_in_flight"] = self._remove_in_flight(server.hs_dir)

    @staticmethod
    def _remove_in_flight(hs_dir: Path) -> int:
        """Hidden-state files still on disk after training (the trainer deletes each after use;
        an interrupted request can leave one): counted for the record, then removed."""
        left = [p for p in hs_dir.iterdir() if p.is_file()] if hs_dir.is_dir() else []
        shutil.rmtree(hs_dir, ignore_errors=True)
        return len(left)

    def record(self) -> dict[str, Any]:
        return {"mode": self.mode, "storage": self.storage, "transfer": self.spec.format.transfer_backend,
                **self.manifest, "server_layer_ids": self.spec.layer_ids, "bytes_on_disk": 0,
                "server": self.server_info}


SOURCES = {"offline": OfflineSource, "online": OnlineSource}


@contextlib.contextmanager
def speculators_graceful_shutdown_off() -> Iterator[None]:
    """Leave SIGINT/SIGTERM to StopOnSignals while speculators trains online.

    speculators' graceful-shutdown handler turns the first SIGINT/SIGTERM into an exception
    (TrainingInterruptedError) and ignores the rest. Training online, that exception almost
    always lands inside a hidden-states request, in speculators' own retry loops
    (`except Exception` in vllm_client.with_retries and GenerationRecoveryGuard), which retry and
    carry on: the job ignores Snakemake's or SLURM's SIGTERM until it is killed. StopOnSignals
    raises JobStopped, a BaseException those loops let through; completed epochs are the resume
    points (the pipeline never resumes from speculators' mid-epoch `interrupted` save)."""
    from speculators.train import graceful_shutdown

    handler = graceful_shutdown.GracefulShutdownHandler
    original = handler.install
    handler.install = lambda self: None  # restore() is then a no-op too (nothing installed)
    try:
        yield
    finally:
        handler.install = original


@contextlib.contextmanager
def online_trainer_process() -> Iterator[None]:
    """A torchrun worker of online training: stop on SIGINT/SIGTERM/SIGHUP (torchrun forwards
    them) with a clean error, not speculators' swallowed interrupt."""
    try:
        with StopOnSignals(), speculators_graceful_shutdown_off():
            yield
    except JobStopped as stop:
        raise PipelineError(str(stop)) from None


def trainer_process(argv: list[str]):
    """The signal handling a trainer process started with these speculators flags needs."""
    online = "--on-missing" in argv and argv[argv.index("--on-missing") + 1] == "generate"
    return online_trainer_process() if online else contextlib.nullcontext()


def training_source(args, settings: dict[str, Any]):
    mode = settings.get("mode", "offline")
    if mode not in SOURCES:
        raise PipelineError(f"hidden_states.mode = {mode!r}: use one of {', '.join(SOURCES)}")
    return SOURCES[mode](args, settings)
