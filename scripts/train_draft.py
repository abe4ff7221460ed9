#!/usr/bin/env python
"""Train one EAGLE-3 draft with speculators' own trainer (speculator_type eagle3).

Reads the hidden-states data dir and its manifest (the aux layer ids come only from there) or,
with `hidden_states.mode: online` (--hs-settings), the tokenized data and a vLLM server this job
starts, asks for each sample's hidden states and stops again (pipeline_lib.hidden_states.training),
builds the draft vocabulary maps (d2t/t2d) with speculators' vocab-mapping code, and runs
`speculators.train.cli.main` in this process (CPU or one GPU), under torchrun (one process per
GPU, or --cpu-processes gloo processes on a machine without GPUs) or under srun + torchrun
(several nodes). Epoch checkpoints go to --checkpoints, which is
not a declared output: a killed run resumes from its latest complete epoch.

Writes
  --final      the selected epoch (best validation loss or last), verifier path made relative
  --untrained  the same draft and vocab maps before any training step (verification baseline)
  --metrics    CSV, one row per (epoch, split): loss, acc_0..acc_{k-1}, throughput
  --provenance what made them
  --hs-record  the hidden states it trained on: mode, storage, layer ids (and the server's)

    python scripts/train_draft.py --settings '{"epochs": 2, ...}' --target T --target-manifest M \\
        --data D --hs-manifest H --checkpoints C --final F --untrained U --metrics X.csv \\
        --provenance P.json [--gpus 0] [--nodes 1] [--cpu-processes 1] [--hs-record R.json]
    (online: --hs-settings '{"mode": "online", ...}' --data R/tokenized/data
             --token-freq R/tokenized/token_freq.pt, no --hs-manifest)
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, launch, runtime, speculators_cpu  # noqa: E402
from pipeline_lib import target as target_lib  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.hidden_states.training import trainer_process, training_source  # noqa: E402
from pipeline_lib.io import (append_jsonl_durable, atomic_dir, atomic_write_bytes,  # noqa: E402
                             atomic_write_json, atomic_write_text, read_json, reporting_disk_full,
                             require_free_space)
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.training import checkout  # noqa: E402

SECTION = "train"
METRICS_LOG = "metrics.jsonl"          # per-epoch train/val metrics, appended across resumes
FINGERPRINT = "pipeline_fingerprint.json"
UNTRAINED_BUILD = ".untrained-build"   # not an epoch number: speculators' resume scan skips it
WORKER_SPEC = ".trainer-worker.json"
# Files of a speculators checkpoint that make up the vLLM-loadable draft besides config.json
# (rewritten) and the *.safetensors weights.
DRAFT_EXTRA_FILES = ("generation_config.json", "model.safetensors.index.json")
RESUME_ONLY_FILES = ("optimizer_state_dict.pt", "scheduler_state_dict.pt")
# speculators writes training_state.json last when it saves an epoch: a readable one for that
# epoch's end marks a complete save (a save killed half-way leaves none, or a torn one). It
# saves BEFORE validating the epoch, so an epoch is complete only once its validation row is
# in METRICS_LOG too: a run killed in between would otherwise resume past an epoch whose
# metrics and best-epoch candidacy were never recorded.
COMPLETE_MARKER = "training_state.json"
HISTORY = "training_history.json"      # one entry per run that trained into these checkpoints
# Settings that do not shape the training trajectory: they may change between a run and its
# resume. Everything else (epochs included: the lr schedule spans them) is in the fingerprint.
NOT_IN_FINGERPRINT = {"keep_last", "select", "num_workers", "extend_epochs"}


# --------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class TrainSettings:
    draft_layers: int
    draft_vocab_size: int
    ttt_steps: int
    epochs: int
    lr: float
    optimizer: str
    scheduler: str
    total_seq_len: int
    train_data_ratio: float
    attn_impl: str
    loss_impl: str
    seed: int
    keep_last: int
    select: str
    num_workers: int
    extend_epochs: bool = False

    OPTIONAL = {"extend_epochs": False}
    CHOICES = {"optimizer": ("adamw", "muon"), "scheduler": ("linear", "cosine", "none"),
               "attn_impl": ("sdpa", "simple_flex_attention", "eager"),
               "loss_impl": ("eager", "fused"), "select": ("best", "last")}
    MINIMA = {"draft_layers": 1, "draft_vocab_size": 2, "ttt_steps": 1, "epochs": 1,
              "total_seq_len": 16, "keep_last": 1, "num_workers": 0}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainSettings":
        values = {}
        for name, kind in cls.__annotations__.items():  # the fields (CHOICES/MINIMA are not annotated)
            value = raw.get(name, cls.OPTIONAL[name]) if name in cls.OPTIONAL else cli.require(raw, name, SECTION)
            if kind == "bool" and not isinstance(value, bool):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected true or false")
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected an integer")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected a number")
            if name in cls.CHOICES and value not in cls.CHOICES[name]:
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: choose one of "
                                    f"{', '.join(cls.CHOICES[name])}")
            if name in cls.MINIMA and value < cls.MINIMA[name]:
                raise PipelineError(f"setting {SECTION}.{name} = {value}: must be >= {cls.MINIMA[name]}")
            values[name] = float(value) if kind == "float" else value
        if values["lr"] <= 0:
            raise PipelineError(f"setting {SECTION}.lr = {values['lr']}: must be > 0")
        if not 0 < values["train_data_ratio"] < 1:
            raise PipelineError(
                f"setting {SECTION}.train_data_ratio = {values['train_data_ratio']}: speculators "
                f"validates on the last rows, so it must be strictly between 0 and 1 (e.g. 0.9)")
        unknown = sorted(set(raw) - set(values))
        if unknown:
            raise PipelineError(f"unknown {SECTION} setting(s) {unknown}; see config.yaml for the valid keys")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_device_settings(settings: TrainSettings, on_cpu: bool) -> None:
    if not on_cpu:
        return
    problems = []
    if settings.attn_impl == "simple_flex_attention":
        problems.append("train.attn_impl: simple_flex_attention has no CPU backward; use sdpa")
    if settings.loss_impl == "fused":
        problems.append("train.loss_impl: the fused loss needs Triton (GPU); use eager")
    if settings.num_workers != 0:
        problems.append(f"train.num_workers = {settings.num_workers}: CPU training needs 0")
    if problems:
        raise PipelineError("training on CPU (no GPU requested or visible) needs other settings "
                            "for this variant: " + "; ".join(problems))


# ------------------------------------------------------------------------------ input checks

@dataclass(frozen=True)
class TrainingInputs:
    aux_layer_ids: list[int]
    hidden_size: int
    target_vocab_size: int
    rows: int
    tokens: int
    train_rows: int
    target_digest: str
    data_digest: str | None


def check_inputs(args, settings: TrainSettings, source) -> TrainingInputs:
    """Refuse to train on inputs that would silently produce a wrong or useless draft. `source`
    (offline files or an online server) describes the hidden states like the offline manifest."""
    target_dir, data_dir = Path(args.target), Path(args.data)
    tm_path = Path(args.target_manifest)
    target_manifest = target_lib.load_manifest(tm_path)
    config = target_lib.text_config(target_lib.load_config(target_dir))
    if "weights_digest" not in target_manifest:
        raise PipelineError(f"{tm_path}: key 'weights_digest' is missing; re-run the target stage")
    hs = source.describe(target_dir, target_manifest)
    hs_path = source.where

    if hs["target_digest"] != target_manifest["weights_digest"]:
        raise PipelineError(
            f"{hs_path}: target_digest {hs['target_digest']} differs from the target's weights_digest "
            f"{target_manifest['weights_digest']} ({tm_path}): the hidden states were extracted from "
            f"another target; re-run the hidden_states stage for this target")

    n_layers = target_lib.num_layers(config)
    aux = target_lib.resolve_aux_layer_ids(hs["aux_layer_ids"], n_layers, setting=f"{hs_path}: aux_layer_ids")
    if hs["final_layer_id"] != n_layers:
        raise PipelineError(f"{hs_path}: final_layer_id = {hs['final_layer_id']} but the target has "
                            f"{n_layers} layers; re-run the hidden_states stage for this target")
    hidden = int(config["hidden_size"])
    if hs["hidden_size"] != hidden:
        raise PipelineError(f"{hs_path}: hidden_size = {hs['hidden_size']} but the target's is {hidden}; "
                            f"re-run the hidden_states stage for this target")

    vocab = int(config["vocab_size"])
    if settings.draft_vocab_size > vocab:
        raise PipelineError(f"setting {SECTION}.draft_vocab_size = {settings.draft_vocab_size} is larger "
                            f"than the target's vocabulary ({vocab} tokens, {target_dir}/config.json); "
                            f"set it to at most {vocab}")

    rows = int(hs["rows"])
    if rows == 0:
        raise PipelineError(f"{hs_path}: the dataset is empty (rows = 0): nothing to train on; check "
                            f"the traces/tokenize stages (all rows failed or were dropped?)")
    seq_lens = _check_dataset(data_dir, rows, hs_path)
    source.check_files(hs, seq_lens, len(aux) + 1, hidden)

    train_rows = int(rows * settings.train_data_ratio)
    if not 0 < train_rows < rows:
        raise PipelineError(
            f"setting {SECTION}.train_data_ratio = {settings.train_data_ratio} leaves "
            f"{train_rows} training and {rows - train_rows} validation rows of {rows}; both must be "
            f"non-empty: use more prompts or another ratio")
    return TrainingInputs(aux_layer_ids=aux, hidden_size=hidden, target_vocab_size=vocab, rows=rows,
                          tokens=sum(seq_lens), train_rows=train_rows,
                          target_digest=hs["target_digest"], data_digest=hs.get("data_digest"))


def _check_dataset(data_dir: Path, rows: int, hs_path: str) -> list[int]:
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(data_dir))
    except Exception as err:  # datasets raises several types for a non-dataset dir
        raise PipelineError(f"{data_dir}: not a datasets save_to_disk dir ({err}); re-run the "
                            f"hidden_states stage") from None
    if len(ds) != rows:
        raise PipelineError(f"{data_dir}: the dataset has {len(ds)} rows but {hs_path} lists {rows}; "
                            f"the data dir and its manifest are out of sync: re-run the hidden_states stage")
    for column in ("input_ids", "loss_mask", "seq_len"):
        if column not in ds.column_names:
            raise PipelineError(f"{data_dir}: column '{column}' is missing (has {ds.column_names})")
    if ds.format.get("type") != "torch":
        raise PipelineError(f"{data_dir}: the dataset is saved in '{ds.format.get('type') or 'python'}' "
                            f"format; speculators needs torch format (set_format('torch') before "
                            f"save_to_disk): re-run the tokenize stage")
    feature = ds.features["input_ids"]
    dtype = getattr(getattr(feature, "feature", feature), "dtype", None)
    if dtype != "int64":
        # speculators compares int64 token ids with input_ids and silently skips every
        # mismatching row, so an int32 column would train on nothing.
        raise PipelineError(f"{data_dir}: input_ids are {dtype}, speculators needs int64; re-run the "
                            f"tokenize stage")
    return [int(n) for n in ds.with_format(None)["seq_len"]]


# ------------------------------------------------------------------------- checkpoints dir

def epoch_dirs(ckpt: Path, complete_only: bool = True) -> dict[int, Path]:
    out = {}
    validated = {r["epoch"] for r in read_metrics_log(ckpt / METRICS_LOG) if r.get("split") == "val"}
    if ckpt.is_dir():
        for d in ckpt.iterdir():
            if d.is_dir() and not d.is_symlink() and d.name.isdigit():
                if not complete_only or (_is_saved(d) and int(d.name) in validated):
                    out[int(d.name)] = d
    return dict(sorted(out.items()))


def read_metrics_log(path: Path) -> list[dict]:
    """The rows of METRICS_LOG; a torn last line (a killed append) is skipped."""
    rows = []
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("epoch"), int):
                rows.append(row)
    return rows


def _is_saved(epoch_dir: Path) -> bool:
    """speculators wrote this epoch's end-of-epoch state: everything before it is on disk."""
    try:
        state = json.loads((epoch_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("epoch") == int(epoch_dir.name) and not state.get("local_step")


def trajectory_fingerprint(settings: TrainSettings, inputs: TrainingInputs,
                           source: dict[str, Any]) -> dict[str, Any]:
    """Everything that shapes the training trajectory: the settings (the schedule's length,
    `epochs`, included), the inputs' digests, how the hidden states are stored and served
    (`source`: the training source's fingerprint) and the trainer version."""
    return {**{k: v for k, v in settings.as_dict().items() if k not in NOT_IN_FINGERPRINT},
            "target_digest": inputs.target_digest, "data_digest": inputs.data_digest,
            "rows": inputs.rows, "aux_layer_ids": inputs.aux_layer_ids,
            "speculators": speculators_cpu.installed_version(), **source}


def prepare_checkpoints(ckpt: Path, fingerprint: dict, epochs: int, extend_epochs: bool = False) -> int | None:
    """Make --checkpoints safe to resume from; returns the epoch it resumes after (or None).

    Only checkpoints of the same trajectory are resumed: same fingerprint, fewer epochs done
    than asked for. A changed `epochs` is a different trajectory when a schedule decays the
    learning rate over them (a finished 4-epoch linear run ends at lr 0); it continues only
    with `extend_epochs: true`, and the training history records the extension. Checkpoints
    that cannot be resumed are moved aside (never deleted), and training starts over."""
    ckpt.mkdir(parents=True, exist_ok=True)
    fp_path = ckpt / FINGERPRINT
    old = json.loads(fp_path.read_text()) if fp_path.exists() else None
    complete = epoch_dirs(ckpt)
    history = json.loads((ckpt / HISTORY).read_text()) if (ckpt / HISTORY).exists() else []
    changed = sorted(k for k in set(old or {}) | set(fingerprint) if (old or {}).get(k) != fingerprint.get(k))
    epochs_only = changed == ["epochs"]
    stale_reason = None
    if complete and old is None:
        stale_reason = f"no {FINGERPRINT}: made outside this pipeline"
    elif changed and not (epochs_only and (extend_epochs or fingerprint.get("scheduler") == "none")):
        stale_reason = f"made with different {', '.join(changed)}"
        if epochs_only:
            stale_reason += (f" ({old['epochs']} -> {fingerprint['epochs']}: the {fingerprint.get('scheduler')} "
                             f"learning-rate schedule spans the epochs, so resuming would not make what "
                             f"{fingerprint['epochs']} epochs make; set train.extend_epochs: true to continue "
                             f"the old run anyway)")
    elif complete and max(complete) >= epochs:
        stale_reason = f"already trained {max(complete) + 1} epochs, more than the {epochs} asked for"
    if stale_reason and (complete or any(ckpt.iterdir())):
        stamp = time.strftime('%Y%m%dT%H%M%S')
        aside = ckpt.with_name(f"{ckpt.name}.superseded-{stamp}")
        for n in itertools.count(2):  # never onto an earlier set moved aside in the same second
            if not aside.exists():
                break
            aside = ckpt.with_name(f"{ckpt.name}.superseded-{stamp}-{n}")
        os.replace(ckpt, aside)
        log(f"WARNING: checkpoints in {ckpt} were {stale_reason}; moved them to {aside} "
            f"(delete it when no longer needed) and starting fresh")
        ckpt.mkdir(parents=True)
        complete, history = {}, []
    atomic_write_json(fp_path, fingerprint)
    remove_incomplete_epochs(ckpt)
    latest = max(complete) if complete else None
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "epochs": epochs,
             "resumed_after_epoch": latest}
    if latest is not None and epochs_only and old:
        entry["extended_from_epochs"] = old["epochs"]
        log(f"WARNING: continuing a {old['epochs']}-epoch run to {epochs} epochs (train.extend_epochs or "
            f"scheduler none); the training history in provenance records it")
    atomic_write_json(ckpt / HISTORY, [*history, entry])
    if latest is not None:
        log(f"resuming after epoch {latest} from {complete[latest]}")
    return latest


def remove_incomplete_epochs(ckpt: Path) -> None:
    """Epoch dirs whose save was interrupted (killed, disk full): speculators would try to
    resume from them and crash, and they hold space."""
    complete = epoch_dirs(ckpt)
    for n, d in epoch_dirs(ckpt, complete_only=False).items():
        if n not in complete:
            log(f"removing incomplete epoch checkpoint {d} (its save or its validation was interrupted)")
            shutil.rmtree(d)
    for link in ckpt.glob("epoch*_*"):
        if link.is_symlink() and not link.exists():
            link.unlink()


def epoch_checkpoint_bytes(draft_dir: Path) -> int:
    """What one epoch checkpoint takes: the weights, plus Adam's two moments of at most as many
    values, which speculators also saves in bf16."""
    return 2 * sum(f.stat().st_size for f in draft_dir.glob("*.safetensors"))


def training_history(ckpt: Path) -> list[dict]:
    path = ckpt / HISTORY
    return json.loads(path.read_text()) if path.exists() else []


def best_epoch(ckpt: Path) -> int | None:
    """The complete epoch with the lowest validation loss (the first, on ties: speculators'
    rule), from the metrics log, which a kill cannot leave behind the checkpoints as it can
    speculators' checkpoint_best link (updated after validation, lost if killed before)."""
    complete = epoch_dirs(ckpt)
    losses = {r["epoch"]: r["metrics"].get("loss") for r in read_metrics_log(ckpt / METRICS_LOG)
              if r.get("split") == "val" and r["epoch"] in complete}
    losses = {e: v for e, v in losses.items() if isinstance(v, (int, float))}
    if losses:
        return min(sorted(losses), key=lambda e: losses[e])
    link = ckpt / "checkpoint_best"
    if link.is_symlink():
        name = Path(os.readlink(link)).name
        return int(name) if name.isdigit() else None
    return None


def prune(ckpt: Path, keep_last: int, keep: set[int]) -> dict[str, list[int]]:
    """Keep the newest `keep_last` epochs plus `keep` (the best one: checkpoint_best points at it
    and resume restores best_val_loss from it); optimizer/scheduler state only in the latest."""
    complete = epoch_dirs(ckpt)
    kept = set(list(complete)[-keep_last:]) | (keep & set(complete))
    removed = []
    for n, d in complete.items():
        if n not in kept:
            shutil.rmtree(d)
            removed.append(n)
            for link in ckpt.glob(f"epoch{n}_*"):
                if link.is_symlink():
                    link.unlink()
    latest = max(complete)
    for n in kept - {latest}:
        for name in RESUME_ONLY_FILES:
            (complete[n] / name).unlink(missing_ok=True)
    interrupted = ckpt / "interrupted"
    if interrupted.is_dir():  # a graceful-shutdown save from an earlier, now superseded run
        shutil.rmtree(interrupted)
    return {"kept": sorted(kept), "removed": removed, "optimizer_state_in": [latest]}


# ------------------------------------------------------------------------------- vocab maps

def write_vocab_maps(token_freq_path: Path, draft_vocab: int, target_vocab: int, out_dir: Path) -> tuple[Path, Path]:
    """d2t/t2d with speculators' own mapping code, written into the training work dir (the
    data dir belongs to the hidden_states rule)."""
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if not token_freq_path.exists():
        raise PipelineError(f"{token_freq_path}: missing; the draft vocabulary is built from it. "
                            f"Re-run the hidden_states stage (it links the tokenizer's token_freq.pt)")
    try:
        freq = torch.load(token_freq_path, weights_only=True)
    except Exception as err:
        raise PipelineError(f"{token_freq_path}: cannot be loaded ({err}); re-run the tokenize stage") from None
    if not isinstance(freq, dict) or not freq or sum(freq.values()) <= 0:
        raise PipelineError(f"{token_freq_path}: no loss-masked token counts; the dataset has nothing "
                            f"to learn (check tokenize: reasoning/answer masks)")
    bad = [t for t in freq if not 0 <= int(t) < target_vocab]
    if bad:
        raise PipelineError(f"{token_freq_path}: token ids {sorted(bad)[:5]} are outside the target "
                            f"vocabulary (0..{target_vocab - 1}): it was counted with another tokenizer")
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, target_vocab)
    paths = out_dir / f"d2t-{draft_vocab}.npy", out_dir / f"t2d-{draft_vocab}.npy"
    for path, tensor in zip(paths, (d2t, t2d)):
        buf = io.BytesIO()
        np.save(buf, tensor.cpu().numpy())
        atomic_write_bytes(path, buf.getvalue())
    covered = sum(c for t, c in freq.items() if t2d[int(t)])
    log(f"draft vocabulary: {draft_vocab} of {target_vocab} tokens, covering "
        f"{covered / sum(freq.values()):.1%} of the {sum(freq.values())} loss-masked tokens")
    return paths


# -------------------------------------------------------------------------- trainer process

def trainer_argv(settings: TrainSettings, inputs: TrainingInputs, target: Path, data: Path,
                 ckpt: Path, d2t: Path, t2d: Path) -> list[str]:
    """speculators train flags for this variant (`speculators train --help` lists them), except
    the hidden-states data flags (the source's serving() gives those)."""
    s = settings
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(target.resolve()),
        "--data-path", str(data.resolve()),
        "--save-path", str(ckpt.resolve()),
        "--log-dir", str((ckpt / "logs").resolve()),
        "--target-layer-ids", *map(str, inputs.aux_layer_ids),
        "--draft-vocab-size", str(s.draft_vocab_size),
        "--d2t-path", str(d2t.resolve()), "--t2d-path", str(t2d.resolve()),
        "--num-layers", str(s.draft_layers),
        "--ttt-steps", str(s.ttt_steps),
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
        # Every epoch is saved (so the last one is too: with N > 1 speculators skips epochs
        # where N doesn't divide epoch+1) and is a resume point.
        "--checkpoint-freq", "1",
        "--log-freq", "1",
        # How the hidden states are read (transfer backend, --on-missing, a server endpoint)
        # is added by the hidden-states source while it serves them.
    ]


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


# ------------------------------------------------------------------------------- outputs

def export_draft(src: Path, dest: Path, target: Path, aux: list[int]) -> None:
    """Copy a checkpoint's draft files into `dest` (atomically), with the verifier path made
    relative to `dest` so results/ can move. Weights are hard-linked where possible."""
    config = json.loads((src / "config.json").read_text())
    if config.get("eagle_aux_hidden_state_layer_ids") != aux:
        raise PipelineError(f"{src}/config.json: eagle_aux_hidden_state_layer_ids = "
                            f"{config.get('eagle_aux_hidden_state_layer_ids')}, expected {aux}; vLLM "
                            f"would silently fall back to its default ids")
    verifier = config["speculators_config"]["verifier"]
    verifier["name_or_path"] = os.path.relpath(os.path.abspath(target), os.path.abspath(dest))
    with atomic_dir(dest) as tmp:
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        for f in sorted(src.iterdir()):
            if f.name in DRAFT_EXTRA_FILES or f.suffix == ".safetensors":
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)


def write_metrics_csv(metrics_log: Path, epochs: int, ttt_steps: int, out: Path) -> Any:
    """train_metrics.csv from the metrics log; returns the pandas DataFrame."""
    import pandas as pd

    rows: dict[tuple[int, str], dict] = {}
    for rec in read_metrics_log(metrics_log):
        if rec["epoch"] < epochs:
            rows[(rec["epoch"], rec["split"])] = rec  # a retrained epoch: last one wins
    table = []
    for (epoch, split), rec in sorted(rows.items()):
        m = rec["metrics"]
        row = {"epoch": epoch, "split": split, "loss": m.get("loss")}
        # acc_i: fraction of positions whose draft tokens 0..i are all right (speculators'
        # full_acc_i), the chance that position i is accepted under greedy verification.
        row.update({f"acc_{i}": m.get(f"full_acc_{i}") for i in range(ttt_steps)})
        if split == "train":
            steps, step_s = rec.get("steps") or 0, rec.get("step_s") or 0.0
            # step_s: speculators' own per-step timer (data fetch + forward + backward + optimizer).
            row.update({"steps": steps, "tokens": rec.get("tokens"), "step_s": step_s,
                        "steps_per_s": steps / step_s if step_s else None,
                        "tokens_per_s": rec.get("tokens", 0) / step_s if step_s else None,
                        "first_step_s": rec.get("first_step_s")})
            row.update({f"{phase}_s": v for phase, v in (rec.get("phase_s") or {}).items()})
        row.update({k: v for k, v in sorted(m.items()) if k != "loss"})
        table.append(row)
    df = pd.DataFrame(table)
    for col in ("steps", "tokens"):
        if col in df:
            df[col] = df[col].astype("Int64")
    atomic_write_text(out, df.to_csv(index=False))
    return df


# ----------------------------------------------------------------------------------- main

def log(msg: str) -> None:
    print(f"[train_draft] {msg}", flush=True)


def parse_args():
    p = cli.parser(__doc__)
    p.add_argument("--target", help="target model dir (HF format)")
    p.add_argument("--target-manifest", help="target/manifest.json (its weights_digest)")
    p.add_argument("--data", help="speculators data dir (dataset + hidden_states/ + token_freq.pt)")
    p.add_argument("--hs-manifest", help="hidden_states/manifest.json (aux layer ids, rows, files)")
    p.add_argument("--checkpoints", help="epoch checkpoints + work files (kept across runs: resume)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs in total over all nodes (0: train on CPU)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (> 1: srun + torchrun under SLURM)")
    p.add_argument("--cpu-processes", type=int, default=1,
                   help="with --gpus 0: training processes on this machine's CPU (> 1: torchrun over gloo)")
    p.add_argument("--final", help="output: the selected epoch's draft, vLLM-loadable")
    p.add_argument("--untrained", help="output: the same draft before training")
    p.add_argument("--metrics", help="output: per-(epoch, split) metrics CSV")
    p.add_argument("--provenance", help="output: provenance.json")
    p.add_argument("--hs-settings", type=cli.json_object, default={"mode": "offline"},
                   help="JSON: config.yaml `hidden_states` (mode, storage, and for online mode aux_layer_ids, "
                        "dtype, server_gpus, server_start_timeout_s, request_timeout_s)")
    p.add_argument("--token-freq", help="token_freq.pt for the draft vocabulary (default: DATA/token_freq.pt)")
    p.add_argument("--hs-record", help="output: the hidden states trained on (mode, storage, layer ids)")
    p.add_argument("--trainer-worker", help=argparse.SUPPRESS)  # set by launch for torchrun processes
    args = p.parse_args()
    if not args.trainer_worker:
        required = ("target", "target_manifest", "data", "checkpoints", "final", "untrained", "metrics",
                    "provenance")
        missing = ["--" + k.replace("_", "-") for k in required if not getattr(args, k)]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def select_device(gpus: int) -> bool:
    """True when training runs on CPU. `gpu: 0` means CPU even on a GPU host."""
    if gpus == 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    runtime.setup()
    on_cpu = not runtime.has_cuda()
    if gpus > 0 and on_cpu:
        raise PipelineError(f"--gpus {gpus} but no CUDA device is visible; set resources.train.gpu: 0 "
                            f"to train on CPU")
    if on_cpu:
        speculators_cpu.check_version()
    return on_cpu


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


def selected_checkpoint(ckpt: Path, settings: TrainSettings, started: float) -> tuple[int, int | None]:
    complete = epoch_dirs(ckpt)
    last = settings.epochs - 1
    interrupted = ckpt / "interrupted"
    if last not in complete and interrupted.is_dir() and interrupted.stat().st_mtime >= started:
        # speculators catches SIGINT/SIGTERM, saves a mid-epoch checkpoint and returns normally.
        resume = f"epoch {max(complete)}" if complete else "the start"
        raise PipelineError(f"training was interrupted (SIGINT/SIGTERM); re-run to resume from {resume} "
                            f"({ckpt}); speculators' mid-epoch save is in {interrupted}")
    if last not in complete:
        raise PipelineError(f"training ended without a complete checkpoint of the last epoch ({last}) "
                            f"in {ckpt} (have {list(complete)}); re-run to resume")
    best = best_epoch(ckpt)
    selected = best if settings.select == "best" and best is not None else last
    if selected not in complete:
        raise PipelineError(f"the {settings.select} epoch ({selected}) has no checkpoint in {ckpt}; "
                            f"delete {ckpt} to retrain from scratch")
    return selected, best


def val_summary(df, epoch: int, ttt_steps: int) -> dict[str, float]:
    if not len(df):
        return {}
    row = df[(df["split"] == "val") & (df["epoch"] == epoch)]
    cols = ["loss", *[f"acc_{i}" for i in range(ttt_steps)]]
    return {f"val_{c}": float(row.iloc[0][c]) for c in cols if len(row) and c in row}


def main() -> int | None:
    args = parse_args()
    if args.trainer_worker:
        return run_worker(args.trainer_worker)

    settings = TrainSettings.from_dict(args.settings)
    source = training_source(args, args.hs_settings)  # offline files or an online vLLM server
    gpus = source.claim_devices(args.gpus)             # online: the server's GPUs are not the trainer's
    mode = launch.select_mode(gpus, args.nodes, args.cpu_processes)
    on_cpu = select_device(gpus)
    check_device_settings(settings, on_cpu)
    prov = Provenance("train_draft", settings.as_dict())
    inputs = check_inputs(args, settings, source)
    log(f"{inputs.rows} rows ({inputs.train_rows} train), {inputs.tokens} tokens, aux layers "
        f"{inputs.aux_layer_ids} from {source.where}; hidden states {source.mode}, storage {source.storage}; "
        f"device {'cpu' if on_cpu else 'cuda'}, launch {mode}")

    ckpt, target, data = Path(args.checkpoints), Path(args.target), Path(args.data)
    trainer_checkout = checkout.checkout_state()
    for stale in checkout.remove_patches(ckpt):  # an earlier speculators run's diff of uncommitted edits
        log(f"removed {stale}")
    resumed_after = prepare_checkpoints(ckpt, trajectory_fingerprint(settings, inputs, source.fingerprint()),
                                        settings.epochs, settings.extend_epochs)
    d2t, t2d = write_vocab_maps(Path(args.token_freq) if args.token_freq else data / "token_freq.pt",
                                settings.draft_vocab_size, inputs.target_vocab_size, ckpt / "vocab")
    argv = trainer_argv(settings, inputs, target, data, ckpt, d2t, t2d)
    metrics_log = ckpt / METRICS_LOG
    install_logging(metrics_log)

    # The untrained baseline first: cheap, and it proves the flags before hours of training.
    untrained_src = build_untrained(argv, ckpt / UNTRAINED_BUILD, on_cpu)
    plan = launch.plan(launch.LaunchRequest(
        gpus=gpus, nodes=args.nodes, cpu_processes=args.cpu_processes,
        worker=[str(Path(__file__).resolve()), "--trainer-worker", str((ckpt / WORKER_SPEC).resolve())]))
    # Every epoch's checkpoint stays until training ends (keep_last prunes afterwards).
    per_epoch = epoch_checkpoint_bytes(untrained_src)
    remaining = settings.epochs - (0 if resumed_after is None else resumed_after + 1)
    what = f"{remaining} epoch checkpoint(s) of about {per_epoch:,} bytes each"
    require_free_space(ckpt, remaining * per_epoch, what)
    started = time.time()
    try:
        with reporting_disk_full(ckpt, what, remaining * per_epoch, per_epoch,
                                 "training resumes after the last complete epoch"):
            with source.serving(log) as data_flags:  # online: the server runs exactly this long
                argv += data_flags
                train(plan, argv, ckpt, metrics_log, on_cpu, gpus)
    except PipelineError:
        remove_incomplete_epochs(ckpt)  # a half-written epoch is never resumed; give its space back
        raise
    train_s = time.time() - started

    selected, best = selected_checkpoint(ckpt, settings, started)
    df = write_metrics_csv(metrics_log, settings.epochs, settings.ttt_steps, Path(args.metrics))
    export_draft(ckpt / str(selected), Path(args.final), target, inputs.aux_layer_ids)
    export_draft(untrained_src, Path(args.untrained), target, inputs.aux_layer_ids)
    shutil.rmtree(untrained_src, ignore_errors=True)
    pruned = prune(ckpt, settings.keep_last, {best} if best is not None else set())

    summary = val_summary(df, selected, settings.ttt_steps)
    hs_record = source.record()
    outputs = {"final": args.final, "untrained": args.untrained, "metrics": args.metrics}
    if args.hs_record:
        atomic_write_json(args.hs_record, hs_record)
        outputs["hs_record"] = args.hs_record
    inputs_used = {"target": args.target, "target_manifest": args.target_manifest, "data": args.data}
    if args.hs_manifest:
        inputs_used["hs_manifest"] = args.hs_manifest
    prov.write(args.provenance, inputs=inputs_used, outputs=outputs,
               selected_epoch=selected, best_epoch=best, resumed_after_epoch=resumed_after,
               training_history=training_history(ckpt), trainer_checkout=trainer_checkout,
               train_wall_s=round(train_s, 3), aux_layer_ids=inputs.aux_layer_ids,
               draft_vocab_size=settings.draft_vocab_size, checkpoints=pruned, trainer_argv=argv,
               launch={"mode": plan.mode, "command": plan.command, "world_size": plan.world_size},
               hidden_states={k: hs_record.get(k) for k in ("mode", "storage", "transfer")},
               **summary)
    log(f"final/ = epoch {selected} ({settings.select}); " +
        ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    run_main(main)
