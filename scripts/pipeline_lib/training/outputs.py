"""What the train_draft rule outputs from the checkpoints: final/ and untrained/ (vLLM-loadable,
verifier path relative) and train_metrics.csv."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import PipelineError
from ..io import atomic_dir, atomic_write_text
from .checkpoints import read_metrics_log

# Files of a speculators checkpoint that make up the vLLM-loadable draft besides config.json
# (rewritten) and the *.safetensors weights.
DRAFT_EXTRA_FILES = ("generation_config.json", "model.safetensors.index.json")


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


def val_summary(df, epoch: int, ttt_steps: int) -> dict[str, float]:
    if not len(df):
        return {}
    row = df[(df["split"] == "val") & (df["epoch"] == epoch)]
    cols = ["loss", *[f"acc_{i}" for i in range(ttt_steps)]]
    return {f"val_{c}": float(row.iloc[0][c]) for c in cols if len(row) and c in row}
