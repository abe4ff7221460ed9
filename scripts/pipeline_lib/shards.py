"""The shard files of a scattered stage (traces, synthesize): shard I of N is <dir>/I-of-N.jsonl
with its summary I-of-N.summary.json beside it, written by the same job."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import PipelineError
from .io import read_json

SHARD_NAME = re.compile(r"^(\d+)-of-(\d+)\.jsonl$")


def shard_index(paths: list[Path]) -> dict[int, Path]:
    """{shard index: path}, checking that the names cover 0..N-1 of a single N exactly once."""
    found: dict[int, Path] = {}
    totals = set()
    for p in paths:
        m = SHARD_NAME.match(p.name)
        if not m:
            raise PipelineError(f"{p}: shard files must be named <i>-of-<n>.jsonl (as the shard jobs write them)")
        i, n = int(m.group(1)), int(m.group(2))
        totals.add(n)
        if i in found:
            raise PipelineError(f"{p}: shard {i} given twice (also {found[i]})")
        found[i] = p
    if len(totals) != 1:
        raise PipelineError(f"shards from different shard counts {sorted(totals)} were given; "
                            f"pass the shards of one num_shards")
    n = totals.pop()
    missing = sorted(set(range(n)) - set(found))
    extra = sorted(set(found) - set(range(n)))
    if missing or extra:
        raise PipelineError(f"shards of {n}: missing {missing}, out of range {extra}; pass all shards 0..{n - 1}")
    return found


def read_shard_summary(path: Path, index: int, n: int, rows: int) -> dict:
    spath = path.with_name(path.name[: -len(".jsonl")] + ".summary.json")
    summary = read_json(spath, "shard summary (written with the shard by its job)")
    if (summary.get("shard"), summary.get("num_shards"), summary.get("rows")) != (index, n, rows):
        raise PipelineError(f"{spath}: describes shard {summary.get('shard')} of {summary.get('num_shards')} with "
                            f"{summary.get('rows')} rows, but {path} is shard {index} of {n} with {rows} rows; "
                            f"regenerate the shard")
    return summary
