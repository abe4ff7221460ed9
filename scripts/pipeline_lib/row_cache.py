"""The row cache of a sharded generation stage (traces, synthesize): each finished row is
appended and fsync'd the moment it is done, keyed by what defines it, outside the declared
outputs (Snakemake deletes those of a failed job), so a failed or interrupted shard resumes
where it stopped and a num_shards change regenerates nothing finished."""
from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import TextIO

from .errors import PipelineError
from .io import append_jsonl_durable


class RowCache:
    """Finished rows of every shard (any num_shards) under one directory; this job appends to
    its own file, which it holds an exclusive lock on (a second copy of the same shard fails
    instead of interleaving writes)."""

    def __init__(self, directory: Path, shard: int, num_shards: int):
        self.dir = directory
        self.path = directory / f"{shard}-of-{num_shards}.jsonl"
        self._file: TextIO | None = None

    def load(self) -> tuple[dict[str, dict], int]:
        """{row key: trace row} from every cache file, and the number of unreadable lines
        skipped (a job killed mid-append leaves a torn last line; another shard may be
        appending right now). The first row per key wins (file names sorted)."""
        rows: dict[str, dict] = {}
        skipped = 0
        if not self.dir.exists():
            return rows, skipped
        for path in sorted(self.dir.glob("*.jsonl")):
            with open(path, "rb") as f:
                for line in f:
                    try:  # strict UTF-8: a damaged line is skipped (and regenerated), never half-read
                        entry = json.loads(line.decode("utf-8"))
                        key, row = entry["key"], entry["row"]
                        if not isinstance(row, dict) or row.get("finish_reason") not in ("stop", "length", "error"):
                            raise ValueError
                    except (ValueError, KeyError, TypeError):
                        skipped += bool(line.strip())
                        continue
                    rows.setdefault(key, row)
        return rows, skipped

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise PipelineError(f"{self.path} is locked by another running copy of this shard; wait for it "
                                f"or stop it (two jobs for one shard would duplicate work)") from None
        # Terminate a torn last line (a killed append) so the next row starts on its own line.
        if f.tell() > 0:
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")
        self._file = f

    def append(self, key: str, gen_key: str, row: dict) -> None:
        assert self._file is not None
        append_jsonl_durable(self._file, {"key": key, "generation_key": gen_key, "row": row})

    def close(self) -> None:
        if self._file is not None:
            if self._file.tell() == 0:  # nothing was ever appended: leave no empty file behind
                self.path.unlink(missing_ok=True)
            self._file.close()
            self._file = None
