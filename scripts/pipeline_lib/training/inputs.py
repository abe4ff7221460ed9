"""What training reads, refused where it would silently produce a wrong or useless draft, and
the draft vocabulary maps built from the loss-token counts."""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from .. import target as target_lib
from ..errors import PipelineError
from ..io import atomic_write_bytes
from . import log
from .settings import SECTION, TrainSettings


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


def write_vocab_maps(token_freq_path: Path, draft_vocab: int, target_vocab: int,
                     out_dir: Path) -> tuple[Path, Path, dict]:
    """d2t/t2d with speculators' own mapping code, written into the training work dir (the
    data dir belongs to the hidden_states rule), and the draft vocabulary's coverage: the share
    of the target's generated (loss-masked) tokens it can propose at all. A token outside it is
    never drafted, so the coverage bounds what a draft vocabulary size can reach."""
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
    total = int(sum(freq.values()))
    covered = int(sum(c for t, c in freq.items() if t2d[int(t)]))
    coverage = {"draft_vocab_size": draft_vocab, "target_vocab_size": target_vocab,
                "distinct_generated_tokens": len(freq), "generated_tokens": total,
                "covered_tokens": covered, "share": round(covered / total, 6)}
    log(f"draft vocabulary: {draft_vocab} of {target_vocab} tokens, covering "
        f"{covered / total:.1%} of the {total} loss-masked tokens ({len(freq)} distinct)")
    return *paths, coverage
