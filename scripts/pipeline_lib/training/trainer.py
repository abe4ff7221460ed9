"""speculators' trainer (any draft type it trains), run in this process or as one torchrun worker per process:
its flags, the capture of its metrics, and the untrained baseline (its --dry-run)."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

from .. import launch, runtime, speculators_cpu
from ..errors import PipelineError
from ..hidden_states.training import trainer_process
from ..io import append_jsonl_durable, atomic_write_json, read_json
from . import checkout
from .inputs import TrainingInputs
from .settings import TrainSettings

UNTRAINED_BUILD = ".untrained-build"   # not an epoch number: speculators' resume scan skips it
WORKER_SPEC = ".trainer-worker.json"


def trainer_argv(settings: TrainSettings, inputs: TrainingInputs, target: Path, data: Path,
                 ckpt: Path, d2t: Path, t2d: Path) -> list[str]:
    """speculators train flags for this variant (`speculators train --help` lists them), except
    the hidden-states data flags (the source's serving() gives those)."""
    s = settings
    return [
        "--speculator-type", s.draft_type,
        "--verifier-name-or-path", str(target.resolve()),
        "--data-path", str(data.resolve()),
        "--save-path", str(ckpt.resolve()),
        "--log-dir", str((ckpt / "logs").resolve()),
        "--target-layer-ids", *map(str, inputs.aux_layer_ids),
        "--draft-vocab-size", str(s.draft_vocab_size),
        "--d2t-path", str(d2t.resolve()), "--t2d-path", str(t2d.resolve()),
        "--num-layers", str(s.draft_layers),
        *type_flags(s),
        "--epochs", str(s.epochs),
        "--lr", repr(s.lr),
        "--optimizer", s.optimizer,
        "--scheduler-type", s.scheduler,
        "--total-seq-len", str(s.total_seq_len),
        "--train-data-ratio", repr(s.train_data_ratio),
        "--draft-attn-impl", s.attn_impl,
        "--loss-implementation", s.loss_impl,
        "--seed", str(s.seed),
        "--num-workers", str(s.num_workers),
        # What training computes in (autocast; hidden states read in it): train.dtype.
        "--hidden-states-dtype", s.dtype,
        # Every epoch is saved (so the last one is too: with N > 1 speculators skips epochs
        # where N doesn't divide epoch+1) and is a resume point.
        "--checkpoint-freq", "1",
        "--log-freq", "1",
        # How the hidden states are read (transfer backend, --on-missing, a server endpoint)
        # is added by the hidden-states source while it serves them.
    ]


def type_flags(s: TrainSettings) -> list[str]:
    """The flags of the draft type's own group (speculators ignores another type's flags
    silently, so only the type's are passed): EAGLE-3's ttt steps; the block size, depths and
    anchors of the parallel types, where set (unset: speculators' per-type default)."""
    flags = ["--ttt-steps", str(s.ttt_steps)] if s.draft_type == "eagle3" else []
    for key in ("block_size", "num_depths", "max_anchors"):
        if getattr(s, key) is not None:
            flags += ["--" + key.replace("_", "-"), str(getattr(s, key))]
    return flags


class EpochMetricsRecorder(logging.Handler):
    """Turns speculators' metric log records into one JSON line per (epoch, split).

    Per-step train records are averaged over the epoch in memory and written, with the epoch's
    validation record, when validation ends; the file is appended durably, so a resumed run
    keeps the rows of the epochs it did not retrain."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.run_started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._reset()

    # Phases of speculators' per-step profile summed per epoch: where an epoch's time goes
    # (fetch = waiting for the data loader, including its workers' start in the first step).
    PHASES = ("fetch", "fwd", "bwd", "opt")

    def _reset(self):
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.tokens = 0.0
        self.step_s = 0.0
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)
        self.first_step_s = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict) or int(os.environ.get("RANK", "0")) != 0:
            return
        if isinstance(msg.get("train"), dict):
            for k, v in msg["train"].items():
                if isinstance(v, (int, float)):
                    self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.steps += 1
            prof = msg.get("profile") or {}
            if prof.get("step_ms"):
                self.step_s += prof["step_ms"] / 1000
                self.tokens += prof.get("tokens_per_s", 0.0) * prof["step_ms"] / 1000
                if self.first_step_s is None:  # holds torch.compile's first compile in a fresh run
                    self.first_step_s = prof["step_ms"] / 1000
                for phase in self.PHASES:
                    self.phase_s[phase] += prof.get(f"{phase}_ms", 0.0) / 1000
        elif isinstance(msg.get("val"), dict):
            epoch = int(msg["epoch"])
            train = {k: v / self.steps for k, v in self.sums.items()} if self.steps else {}
            rows = [
                {"epoch": epoch, "split": "train", "metrics": train, "steps": self.steps,
                 "tokens": round(self.tokens), "step_s": self.step_s, "first_step_s": self.first_step_s,
                 "phase_s": self.phase_s},
                {"epoch": epoch, "split": "val",
                 "metrics": {k.removesuffix("_epoch"): v for k, v in msg["val"].items()}},
            ]
            with open(self.path, "a") as f:
                for row in rows:
                    append_jsonl_durable(f, {**row, "run_started": self.run_started})
            self._reset()


def install_logging(metrics_log: Path) -> None:
    """Metric capture first, then a plain console handler for the job log. Installed on the
    root logger before speculators configures logging, so its rich console handler (which
    rewrites metric dicts into strings before later handlers see them) is not added."""
    from speculators.train.logger import FormatDictFilter

    root = logging.getLogger()
    if any(isinstance(h, EpochMetricsRecorder) for h in root.handlers):
        return
    root.setLevel(logging.INFO)
    root.addHandler(EpochMetricsRecorder(metrics_log))
    console = logging.StreamHandler(sys.stdout)
    console.addFilter(FormatDictFilter())
    console.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(console)


def run_trainer(argv: list[str], on_cpu: bool) -> None:
    """One speculators run (training or --dry-run) through its own CLI entry point, with the
    CPU shims when there is no GPU. Call install_logging() first."""
    if on_cpu:
        speculators_cpu.apply()
    checkout.suppress_patch()
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    try:
        cfg = TrainConfig.resolve(argv)
    except SystemExit as exc:  # argparse already printed speculators' message
        if exc.code:
            raise PipelineError(f"speculators rejected the training flags ({' '.join(argv)}); see "
                                f"its message above") from None
        raise
    speculators_main(cfg)


def run_worker(spec_path: str) -> None:
    """Entry point of each torchrun process (--trainer-worker)."""
    spec = read_json(spec_path, "trainer worker spec")
    runtime.setup()
    install_logging(Path(spec["metrics_log"]))
    with trainer_process(spec["argv"]):  # online: SIGTERM from torchrun stops it cleanly
        run_trainer(spec["argv"], on_cpu=spec["on_cpu"])


def build_untrained(argv: list[str], build_dir: Path, on_cpu: bool) -> Path:
    """speculators' --dry-run: the draft as training would start it (same seed, same init, vocab
    maps and verifier embeddings loaded), saved without any step."""
    if build_dir.exists():
        shutil.rmtree(build_dir)
    dry = list(argv)
    dry[dry.index("--save-path") + 1] = str(build_dir.resolve())
    run_trainer([*dry, "--dry-run"], on_cpu)
    if not (build_dir / "config.json").exists():
        raise PipelineError(f"speculators --dry-run wrote no config.json into {build_dir}")
    return build_dir


def train(plan: launch.LaunchPlan, argv: list[str], ckpt: Path, metrics_log: Path, on_cpu: bool,
          gpus: int) -> None:
    if plan.in_process:
        return run_trainer(argv, on_cpu)
    import torch

    if plan.mode == "torchrun" and torch.cuda.device_count() < gpus:
        raise PipelineError(f"--gpus {gpus} but only {torch.cuda.device_count()} CUDA device(s) are "
                            f"visible to this job")
    atomic_write_json(ckpt / WORKER_SPEC, {"argv": argv, "metrics_log": str(metrics_log.resolve()), "on_cpu": on_cpu})
    rc = launch.run(plan)
    if rc != 0:
        raise PipelineError(f"{plan.mode} training exited with status {rc}; see the log above. "
                            f"Completed epochs stay in {ckpt}: re-running resumes from them")
