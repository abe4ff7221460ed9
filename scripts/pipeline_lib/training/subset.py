"""What the draft trains on: the run's whole training data, or (train.max_conversations) a
nested subset of its conversations, for a data-scaling curve whose sizes share the traces,
tokenized data and hidden states and differ only in training.

A conversation is one trace row; the tokenize stage writes it as one training row, or as
`id`, `id#2`, ... where the chat template forces a new row (tokenized/stats.json `row_ids`,
in dataset order). The subset of size N is the first N conversations of one permutation of
all of them, seeded by train.seed and independent of N, so a smaller subset is contained in
every larger one (with the same seed). Its rows keep their dataset order, so speculators'
train_data_ratio split (the last rows validate) applies to the subset as it does to the
whole set, and N = all conversations is the whole set.

speculators reads the dataset and pairs row i with hidden_states/hs_{i}.safetensors, so the
subset is a scratch data view under the checkpoints dir: the selected rows saved with
`datasets`, the source rows' hidden-state files hard-linked (symlinked across filesystems:
never copied) under their new positions, and a token_freq.pt counted over the subset's
loss-masked tokens (the draft vocabulary comes from the data this draft has, not from rows it
never sees). The view is rebuilt atomically at every run: nothing in it is trusted from an
earlier one."""
from __future__ import annotations

import errno
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PipelineError
from ..io import atomic_dir, atomic_write_bytes, atomic_write_json, read_json
from . import log
from .settings import SECTION, TrainSettings

SUBSET_DIR = "data-subset"   # under --checkpoints; not an epoch number, so speculators' resume scan skips it
SUBSET_ROWS = "rows.json"    # in the view: the source rows it holds, by position
DEFINITION = ("the first {n} conversations of a permutation of all {total}, seeded by train.seed = {seed} "
              "(independent of max_conversations: a smaller subset is contained in every larger one); "
              "their rows in dataset order; token_freq.pt counted over them")
_SPLIT_ROW = re.compile(r"^(.*)#(\d+)$")


@dataclass
class TrainingData:
    """What speculators is given (data dir, token counts), which source rows that is, and the
    provenance record of it. A subset's view is written by materialize()."""
    data: Path
    token_freq: Path
    rows: list[int]                       # source row indices, in the order speculators reads them
    record: dict[str, Any] = field(default_factory=dict)
    view: Path | None = None              # where a subset's view goes (None: the whole data dir)
    source: Path | None = None
    with_hidden_states: bool = True
    table: Any = None

    def materialize(self) -> "TrainingData":
        """Write the subset's view (atomically, replacing an earlier one); the whole data dir
        needs nothing."""
        if self.view is None:
            return self
        import datasets
        from datasets import load_from_disk

        datasets.disable_progress_bars()
        freq = self.table.token_freq(self.rows)
        with atomic_dir(self.view) as tmp:
            load_from_disk(str(self.source)).select(self.rows).flatten_indices().save_to_disk(str(tmp))
            if self.with_hidden_states:
                (tmp / "hidden_states").mkdir()
                for j, i in enumerate(self.rows):
                    _link(self.source / "hidden_states" / f"hs_{i}.safetensors",
                          tmp / "hidden_states" / f"hs_{j}.safetensors")
            import torch

            buf = io.BytesIO()
            torch.save(freq, buf)
            atomic_write_bytes(tmp / "token_freq.pt", buf.getvalue())
            atomic_write_json(tmp / SUBSET_ROWS, {"source": str(self.source), "rows": self.rows})
        r = self.record
        log(f"training subset: {r['conversations']} of {r['of_conversations']} conversations ({r['rows']} of "
            f"{r['subset']['of_rows']} rows, {r['tokens']} tokens, {r['train_rows']} rows train) in {self.view}")
        return self


def conversations(row_ids: list[str]) -> list[list[int]]:
    """Row indices grouped by conversation: a row `<id>#<k>` (k >= 2) right after rows of
    conversation `<id>` continues it (tokenize_traces writes a conversation's rows together)."""
    groups: list[list[int]] = []
    base = None
    for i, rid in enumerate(row_ids):
        m = _SPLIT_ROW.match(rid)
        if groups and m and int(m.group(2)) >= 2 and m.group(1) == base:
            groups[-1].append(i)
        else:
            groups.append([i])
            base = m.group(1) if m and int(m.group(2)) >= 2 else rid
    return groups


def select_conversations(total: int, n: int, seed: int) -> list[int]:
    """Indices of the n conversations of the subset: the first n of a permutation of all
    `total` that depends only on (total, seed)."""
    import numpy as np

    return sorted(int(i) for i in np.random.default_rng(seed).permutation(total)[:n])


def _row_ids(stats_path: Path, rows: int) -> list[str]:
    stats = read_json(stats_path, "tokenize stats (stats.json)")
    row_ids = stats.get("row_ids")
    if not isinstance(row_ids, list) or len(row_ids) != rows:
        have = len(row_ids) if isinstance(row_ids, list) else "no"
        raise PipelineError(f"{stats_path}: {have} row_ids for the {rows} rows of the training data; the "
                            f"tokenized data and its stats are out of sync: re-run the tokenize stage")
    return [str(r) for r in row_ids]


def _link(src: Path, dst: Path) -> None:
    """A hard link (the file, whatever later happens to its path); a relative symlink where
    hard links are not possible. Hidden states are never copied: they are the bulk of a run."""
    try:
        os.link(src, dst)
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        os.symlink(os.path.relpath(src.resolve(), dst.parent.resolve()), dst)


class RowTable:
    """Per-row token counts of the dataset, read from its arrow columns chunk by chunk (runs
    have millions of tokens: never as Python lists, never all of them copied at once)."""

    BATCH = 1024  # rows per batch when counting a subset's tokens

    def __init__(self, ds):
        import numpy as np

        self.ds = ds
        table = ds.with_format("arrow")[:]
        self.seq_len = table.column("seq_len").to_numpy()
        per_chunk = []
        for chunk in table.column("loss_mask").chunks:
            if len(chunk):  # offsets index the chunk's values (sliced chunks too); rows are never empty
                per_chunk.append(np.add.reduceat(chunk.values.to_numpy(), chunk.offsets.to_numpy()[:-1]))
        self.loss_tokens = np.concatenate(per_chunk) if per_chunk else np.zeros(0, dtype=np.int64)

    def counts(self, rows: list[int], train_rows: int) -> dict[str, int]:
        seq = self.seq_len[rows]
        return {"rows": len(rows), "train_rows": train_rows, "tokens": int(seq.sum()),
                "train_tokens": int(seq[:train_rows].sum()), "loss_tokens": int(self.loss_tokens[rows].sum())}

    def token_freq(self, rows: list[int]) -> dict[int, int]:
        """{token id: count} over the loss-masked tokens of `rows` (tokenize's token_freq.pt format)."""
        import numpy as np
        import pyarrow.compute as pc

        total: dict[int, int] = {}
        for start in range(0, len(rows), self.BATCH):
            batch = self.ds.select(rows[start:start + self.BATCH]).with_format("arrow")[:]
            ids, mask = (pc.list_flatten(batch.column(c)).to_numpy() for c in ("input_ids", "loss_mask"))
            for t, c in zip(*np.unique(ids[mask.astype(bool)], return_counts=True)):
                total[int(t)] = total.get(int(t), 0) + int(c)
        return total


def training_data(data: Path, token_freq: Path, stats_path: Path | None, settings: TrainSettings,
                  view_dir: Path, with_hidden_states: bool) -> TrainingData:
    """The data dir and token counts speculators trains on, and what they hold (conversations,
    rows, tokens, the subset's definition) for the provenance; checked here, a subset's view
    written by materialize() (after the checkpoints dir is made ready)."""
    from datasets import load_from_disk

    full = load_from_disk(str(data))
    table = RowTable(full)
    rows = len(full)
    groups = conversations(_row_ids(stats_path, rows)) if stats_path else None
    n = settings.max_conversations
    if n is None or (groups is not None and n == len(groups)):
        counts = table.counts(list(range(rows)), int(rows * settings.train_data_ratio))
        return TrainingData(data, token_freq, list(range(rows)), {
            "conversations": len(groups) if groups is not None else None, "of_conversations":
            len(groups) if groups is not None else None, "max_conversations": n, "subset": None, **counts})
    if groups is None:
        raise PipelineError(f"setting {SECTION}.max_conversations = {n} needs the tokenize stage's stats.json "
                            f"(its row_ids say which rows make a conversation): pass --tokenized-stats")
    if n > len(groups):
        raise PipelineError(
            f"setting {SECTION}.max_conversations = {n} is larger than this run's training data: {len(groups)} "
            f"conversations ({rows} rows, {stats_path}); set it to at most {len(groups)}, or to null for all "
            f"of them (a draft labelled {n} must not train on fewer)")
    chosen = select_conversations(len(groups), n, settings.seed)
    rows_used = sorted(i for c in chosen for i in groups[c])
    train_rows = int(len(rows_used) * settings.train_data_ratio)
    if not 0 < train_rows < len(rows_used):
        raise PipelineError(
            f"setting {SECTION}.max_conversations = {n} gives {len(rows_used)} rows, and train_data_ratio = "
            f"{settings.train_data_ratio} splits them into {train_rows} training and {len(rows_used) - train_rows} "
            f"validation rows; both must be non-empty: raise max_conversations")
    record = {"conversations": n, "of_conversations": len(groups), "max_conversations": n,
              "subset": {"definition": DEFINITION.format(n=n, total=len(groups), seed=settings.seed),
                         "seed": settings.seed, "view": str(view_dir), "source_rows": str(view_dir / SUBSET_ROWS),
                         "of_rows": rows},
              **table.counts(rows_used, train_rows)}
    return TrainingData(view_dir, view_dir / "token_freq.pt", rows_used, record, view=view_dir, source=data,
                        with_hidden_states=with_hidden_states, table=table)
