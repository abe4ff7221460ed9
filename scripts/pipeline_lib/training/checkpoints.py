"""The epoch checkpoints dir (--checkpoints): which epochs are complete, whether it is resumed
or set aside (the trajectory fingerprint), the best epoch, what is kept afterwards."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import speculators_cpu
from ..errors import PipelineError
from ..io import atomic_write_json
from . import log
from .inputs import TrainingInputs
from .settings import TrainSettings

METRICS_LOG = "metrics.jsonl"          # per-epoch train/val metrics, appended across resumes
FINGERPRINT = "pipeline_fingerprint.json"
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
    chosen = {k: v for k, v in settings.as_dict().items() if k not in NOT_IN_FINGERPRINT}
    # Keys added later, at their defaults, are left out: checkpoints made before they existed resume.
    for key, default in (("max_conversations", None), ("draft_type", "eagle3"), ("block_size", None),
                         ("num_depths", None), ("max_anchors", None), ("dtype", "bfloat16")):
        if chosen[key] == default:
            del chosen[key]
    return {**chosen,
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
