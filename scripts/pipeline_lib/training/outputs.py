"""What the train_draft rule outputs from the checkpoints: final/ and untrained/ (vLLM-loadable,
verifier path relative) and train_metrics.csv."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import PipelineError
from ..io import atomic_dir, atomic_write_text
from .checkpoints import read_metrics_log

# Files of a speculators checkpoint that make up the vLLM-loadable draft besides config.json
# (rewritten) and the *.safetensors weights.
DRAFT_EXTRA_FILES = ("generation_config.json", "model.safetensors.index.json")


def export_draft(src: Path, dest: Path, target: Path, aux: list[int], aux_key: str) -> None:
    """Copy a checkpoint's draft files into `dest` (atomically), with the verifier path made
    relative to `dest` so results/ can move. Weights are hard-linked where possible. `aux_key`
    is the config key the draft type stores its aux layer ids under (draft_types.py)."""
    config = json.loads((src / "config.json").read_text())
    if config.get(aux_key) != aux:
        raise PipelineError(f"{src}/config.json: {aux_key} = {config.get(aux_key)}, expected {aux}; vLLM "
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


# Per-position accuracy as speculators logs it, per draft type family: EAGLE-3's full_acc_i
# (positions 0..i all right: the chance that position i is accepted under greedy verification),
# the parallel types' position_p_acc (position p right; DFlash's positions start at 1, after
# the anchor). train_metrics.csv names them acc_0, acc_1, ... in position order.
ACCURACY_KEYS = {"eagle3": re.compile(r"full_acc_(\d+)$")}
PARALLEL_ACCURACY_KEY = re.compile(r"position_(\d+)_acc$")


def accuracy_columns(metrics: dict[str, Any], draft_type: str) -> dict[str, str]:
    """{acc_i: speculators' metric name} in position order."""
    pattern = ACCURACY_KEYS.get(draft_type, PARALLEL_ACCURACY_KEY)
    found = sorted((int(m.group(1)), key) for key in metrics if (m := pattern.match(key)))
    return {f"acc_{i}": key for i, (_, key) in enumerate(found)}


def parameter_count(draft: Path) -> dict[str, int]:
    """Parameters of a saved draft, from the safetensors headers: every floating-point tensor
    (`total`), and without the token embeddings (`without_embeddings`: EAGLE-3 keeps a frozen copy
    of the target's, the DFlash family stores none), the figure to compare draft types by."""
    from safetensors import safe_open

    total = embeddings = 0
    for f in sorted(draft.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                if not sl.get_dtype().startswith(("F", "BF")):  # d2t/t2d: index maps, not parameters
                    continue
                n = 1
                for dim in sl.get_shape():
                    n *= dim
                total += n
                if name.endswith("embed_tokens.weight"):
                    embeddings += n
    return {"total": total, "without_embeddings": total - embeddings}


def write_metrics_csv(metrics_log: Path, epochs: int, draft_type: str, out: Path) -> Any:
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
        row.update({col: m.get(key) for col, key in accuracy_columns(m, draft_type).items()})
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


def val_summary(df, epoch: int) -> dict[str, float]:
    if not len(df):
        return {}
    row = df[(df["split"] == "val") & (df["epoch"] == epoch)]
    cols = ["loss", *sorted((c for c in df.columns if re.fullmatch(r"acc_\d+", c)), key=lambda c: int(c[4:]))]
    return {f"val_{c}": float(row.iloc[0][c]) for c in cols if len(row) and c in row and row.iloc[0][c] is not None
            and row.iloc[0][c] == row.iloc[0][c]}
