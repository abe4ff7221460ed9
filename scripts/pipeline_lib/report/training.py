"""The draft's training, as the report shows it: train_metrics.csv read and summarised (loss
and per-position accuracy per epoch, the selected epoch, what the draft was trained on)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from .. import draft_types
from ..errors import PipelineError
from ..render import Section, Table, fmt

def load_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise PipelineError(f"{path}: train_metrics.csv not found; run the train_draft rule first")
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"epoch", "split"} - set(reader.fieldnames or [])
        if missing:
            raise PipelineError(f"{path}: columns {sorted(missing)} missing (expected epoch, split, loss, acc_0..; "
                                f"see docs/artifacts.md)")
        for lineno, row in enumerate(reader, start=2):
            parsed: dict[str, Any] = {"split": row["split"]}
            for key, value in row.items():
                if key == "split" or value in (None, ""):
                    continue
                try:
                    parsed[key] = float(value)
                except ValueError:
                    if key == "epoch":
                        raise PipelineError(f"{path}:{lineno}: epoch {value!r} is not a number") from None
                    parsed[key] = value
            parsed["epoch"] = int(parsed["epoch"])
            rows.append(parsed)
    return rows


def acc_columns(rows: list[dict]) -> list[str]:
    cols = {k for r in rows for k in r if k.startswith("acc_") and k[4:].isdigit()}
    return sorted(cols, key=lambda c: int(c[4:]))


def training_summary(rows: list[dict], provenance: list[dict]) -> dict[str, Any]:
    accs = acc_columns(rows)
    by_split: dict[str, list[dict]] = {}
    for r in rows:
        by_split.setdefault(r["split"], []).append(r)
    out: dict[str, Any] = {"epochs": len({r["epoch"] for r in rows}), "splits": sorted(by_split)}
    for split, rs in by_split.items():
        rs = sorted(rs, key=lambda r: r["epoch"])
        out[split] = {"last_epoch": rs[-1]["epoch"], "loss": [r.get("loss") for r in rs],
                      "final": {k: rs[-1].get(k) for k in ["loss", *accs]}}
    val = sorted(by_split.get("val", []), key=lambda r: r["epoch"])
    train_prov = next((p for p in provenance if p.get("rule") == "train_draft"), {})
    select = (train_prov.get("settings") or {}).get("select", "best") if isinstance(train_prov.get("settings"), dict) else "best"
    selected = train_prov.get("selected_epoch")
    if selected is None and val:
        with_loss = [r for r in val if isinstance(r.get("loss"), float)]
        selected = (min(with_loss, key=lambda r: r["loss"])["epoch"] if select == "best" and with_loss
                    else val[-1]["epoch"])
    out["selected_epoch"] = selected
    out["selection"] = select
    out["hidden_states"] = train_prov.get("hidden_states")  # mode, storage, transfer
    out["draft_vocab_coverage"] = train_prov.get("draft_vocab_coverage")
    settings = train_prov.get("settings") if isinstance(train_prov.get("settings"), dict) else {}
    # What the comparison of draft types reads: the type, its size and what training cost.
    out["draft_type"] = train_prov.get("draft_type") or settings.get("draft_type", "eagle3")
    out["draft_parameters"] = train_prov.get("draft_parameters")
    # Training time over every epoch, from train_metrics.csv (speculators' own step timer: data,
    # forward, backward, optimizer), so a run that resumed still counts the epochs it kept.
    step_s = [r["step_s"] for r in by_split.get("train", []) if isinstance(r.get("step_s"), float)]
    out["train_step_s"] = round(sum(step_s), 3) if step_s else None
    sel_row = next((r for r in val if r["epoch"] == selected), None)
    out["selected_val"] = {k: sel_row.get(k) for k in ["loss", *accs]} if sel_row else None
    # What the draft was trained on: the traces' conversation and turn counts.
    traces = next((p for p in provenance if p.get("rule") == "traces_gather"), {})
    out["data"] = {"turns": traces.get("turns"), "source": traces.get("source"), **(traces.get("counts") or {})}
    # What the draft itself trained on: all conversations or a subset (train.max_conversations).
    out["training_data"] = train_prov.get("training_data")
    return out


def subset_sentence(used: dict[str, Any] | None) -> str:
    if not used or not used.get("subset"):
        return ""
    return (f"This draft trained on a subset (train.max_conversations): {used['conversations']} of "
            f"{used['of_conversations']} conversations, {used['rows']} rows ({used['train_rows']} train), "
            f"{used['tokens']} tokens: {used['subset']['definition']}.")


def data_sentence(data: dict[str, Any], subset: bool = False) -> str:
    if not data.get("rows"):
        return ""
    return (f"{'The run has' if subset else 'Trained on'} {data['rows']} conversations ({data.get('failed', 0)} "
            f"failed), answers from "
            f"{'the prompt set' if data.get('source') == 'dataset' else 'the target'} "
            f"(generation.turns: {data.get('turns')}): {data.get('turns_answered')} user turns answered, "
            f"{data.get('turns_failed')} failed, {data.get('turns_dropped')} of {data.get('turns_total')} dropped"
            + (" (later turns not asked)" if data.get("turns") == "first" and data.get("turns_dropped") else "") + ".")


def coverage_sentence(cov: dict[str, Any] | None) -> str:
    if not cov:
        return ""
    return (f" Draft vocabulary: {cov['draft_vocab_size']:,} of the target's {cov['target_vocab_size']:,} tokens, "
            f"covering {cov['share']:.1%} of the {cov['generated_tokens']:,} generated tokens trained on "
            f"({cov['distinct_generated_tokens']:,} distinct): the draft can never propose the rest.")


def sections(result: dict) -> list[Section]:
    tr = result["training"]
    accs = [k for k in (tr.get("selected_val") or {}) if k.startswith("acc_")]
    trows = [[split, tr[split]["last_epoch"], *[fmt(tr[split]["final"].get(k)) for k in ["loss", *accs]]]
             for split in tr.get("splits", [])]
    subset = bool((tr.get("training_data") or {}).get("subset"))
    params = tr.get("draft_parameters") or {}
    kind = (f"A {draft_types.get(tr['draft_type']).title} draft (train.draft_type: {tr['draft_type']})"
            + (f" of {params['without_embeddings']:,} parameters without embeddings" if params else "")
            + (f", {tr['train_step_s']:.1f} s of training steps" if tr.get("train_step_s") is not None else "") + "; "
            if tr.get("draft_type") in draft_types.DRAFT_TYPES else "")
    return [Section("Training", [
        f"{kind}{tr.get('epochs')} epoch(s); final/ is the {tr.get('selection')} epoch ({tr.get('selected_epoch')}): "
        f"validation {fmt(tr.get('selected_val'))}. {data_sentence(tr.get('data') or {}, subset)} "
        f"{subset_sentence(tr.get('training_data'))}".rstrip()
        + coverage_sentence(tr.get("draft_vocab_coverage"))
        + (f" Hidden states: {fmt(tr['hidden_states'])}." if tr.get("hidden_states") else "")],
        [Table(["split", "last epoch", "loss", *accs], trows)] if trows else [],
        ["Training loss per epoch", "Per-position accuracy per epoch"])]
