#!/usr/bin/env python
"""Assemble speculators' training data dir from the hidden-states shards.

Checks that every shard describes the same extraction (store key, layer ids, dtype, target
and data digests) and that together they cover every row of the tokenized dataset once, then
builds --out-data as speculators' --data-path:
  <tokenized dataset files>            hard links to the tokenized data
  hidden_states/hs_{i}.safetensors     hard links into the shards' store
  token_freq.pt                        hard link to the tokenized token_freq.pt
(a copy where a hard link is impossible, e.g. across filesystems), and writes --manifest
(layer ids, sizes, per-file digests; the shards computed them while the bytes were in memory,
so nothing is hashed twice) and --provenance.

    python scripts/gather_hidden_states.py --shards R/hidden_states/shards/*-of-2.json \\
        --data R/tokenized/data --token-freq R/tokenized/token_freq.pt \\
        --out-data R/hidden_states/data --manifest R/hidden_states/manifest.json \\
        --provenance R/hidden_states/provenance.json
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, parallel  # noqa: E402
from pipeline_lib.digests import file_digest, manifest_digest  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.hidden_states.store import hs_name, log_to_stderr  # noqa: E402
from pipeline_lib.io import atomic_dir, atomic_write_json, read_json  # noqa: E402
from pipeline_lib.provenance import Provenance, upstream_digest  # noqa: E402

log = logging.getLogger("gather_hidden_states")

# Every shard of one extraction must agree on these.
SHARED_KEYS = ("num_shards", "dataset_rows", "aux_layer_ids", "final_layer_id", "hidden_size", "dtype",
               "storage", "stored_dtype", "target_digest", "data_digest", "store_key", "store_dir")
REQUIRED_KEYS = SHARED_KEYS + ("shard", "row_range", "backend", "rows", "tokens", "bytes", "files", "file_bytes")
# Hard links fail with these when the store and the output are on different filesystems
# or the filesystem has no hard links; anything else is a real error.
NO_LINK_ERRNOS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES}


def parse_args():
    p = cli.parser(__doc__)
    p.add_argument("--shards", required=True, nargs="+", type=Path, help="every shard json of the extraction")
    p.add_argument("--data", required=True, type=Path, help="tokenized dataset dir (datasets save_to_disk)")
    p.add_argument("--token-freq", required=True, type=Path, help="tokenized token_freq.pt")
    p.add_argument("--out-data", required=True, type=Path, help="speculators data dir to build")
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument("--provenance", required=True, type=Path)
    return p.parse_args()


def read_shards(paths: list[Path]) -> list[tuple[Path, dict]]:
    shards = []
    for path in paths:
        shard = read_json(path, "hidden-states shard summary")
        missing = [k for k in REQUIRED_KEYS if k not in shard]
        if missing:
            raise PipelineError(f"{path}: missing {missing}; it was not written by extract_hidden_states.py "
                                f"(delete it and rerun the hidden_states_shard job)")
        shards.append((path, shard))
    return sorted(shards, key=lambda ps: ps[1]["shard"])


def check_shards(shards: list[tuple[Path, dict]]) -> dict:
    """The settings all shards share; PipelineError naming the shard files if they differ or
    do not tile the dataset."""
    first_path, first = shards[0]
    for key in SHARED_KEYS:
        for path, shard in shards[1:]:
            if shard[key] != first[key]:
                raise PipelineError(
                    f"shards disagree on {key}: {first_path} has {first[key]!r}, {path} has {shard[key]!r}; "
                    f"they come from different extractions: rerun every hidden_states_shard job "
                    f"(delete {first_path.parent})")
    n = first["num_shards"]
    indices = [s["shard"] for _, s in shards]
    if indices != list(range(n)):
        raise PipelineError(f"got shards {indices} of {n}: pass each of 0..{n - 1} exactly once")
    stop = 0
    for path, shard in shards:
        start, end = shard["row_range"]
        if start != stop:
            raise PipelineError(f"{path}: rows start at {start}, expected {stop}; shards must tile the dataset")
        stop = end
    if stop != first["dataset_rows"]:
        raise PipelineError(f"shards cover rows 0..{stop} but the dataset has {first['dataset_rows']} rows")
    return {k: first[k] for k in SHARED_KEYS}


def check_data(data_dir: Path, shared: dict) -> None:
    now = upstream_digest(data_dir)
    if now != shared["data_digest"]:
        raise PipelineError(f"{data_dir} changed after hidden states were extracted from it (digest {now} vs "
                            f"{shared['data_digest']}); rerun the hidden_states_shard jobs")


def link_or_copy(src: Path, dst: Path) -> str:
    if not src.is_file():
        raise PipelineError(f"{src}: missing; rerun the job that produced it")
    try:
        os.link(src, dst)
        return "linked"
    except OSError as err:
        if err.errno not in NO_LINK_ERRNOS:
            raise
    shutil.copy2(src, dst)
    return "copied"


def build_data_dir(out: Path, data_dir: Path, token_freq: Path, store: Path,
                   files: dict[str, int]) -> tuple[dict, dict]:
    """Build `out` atomically. Returns ({relative path: digest} of the dataset files and
    token_freq.pt, {linked: n, copied: m})."""
    counts = {"linked": 0, "copied": 0}
    digests = {}
    with atomic_dir(out) as tmp:
        for src in sorted(data_dir.rglob("*")):
            rel = src.relative_to(data_dir)
            if any(part.startswith(".") for part in rel.parts) or src.is_dir():
                continue
            if rel.parts[0] in ("hidden_states", "token_freq.pt"):
                raise PipelineError(f"{src}: the tokenized data dir must not contain {rel.parts[0]}; "
                                    f"rerun the tokenize rule")
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            counts[link_or_copy(src, tmp / rel)] += 1
            digests[str(rel)] = file_digest(tmp / rel)
        (tmp / "hidden_states").mkdir()
        for name, size in files.items():
            src = store / name
            if src.is_file() and src.stat().st_size != size:
                raise PipelineError(f"{src}: {src.stat().st_size} bytes but its shard recorded {size}; the store "
                                    f"changed after extraction: rerun the hidden_states_shard jobs")
            counts[link_or_copy(src, tmp / "hidden_states" / name)] += 1
        counts[link_or_copy(token_freq, tmp / "token_freq.pt")] += 1
        digests["token_freq.pt"] = file_digest(tmp / "token_freq.pt")
    return digests, counts


def main() -> None:
    args = parse_args()
    log_to_stderr()
    shards = read_shards(args.shards)
    shared = check_shards(shards)
    check_data(args.data, shared)

    files, file_bytes = {}, {}
    for _, shard in shards:
        files.update(shard["files"])
        file_bytes.update(shard["file_bytes"])
    expected = [hs_name(i) for i in range(shared["dataset_rows"])]
    if sorted(files) != sorted(expected):
        raise PipelineError(f"shards list {len(files)} hidden-states files for {len(expected)} rows; "
                            f"rerun the hidden_states_shard jobs")
    files = {name: files[name] for name in expected}

    store = Path(shared["store_dir"])
    other_digests, counts = build_data_dir(args.out_data, args.data, args.token_freq, store,
                                           {name: file_bytes[name] for name in expected})
    tokens = sum(s["tokens"] for _, s in shards)
    size = sum(s["bytes"] for _, s in shards)
    backends = sorted({s["backend"] for _, s in shards})
    manifest = {
        "aux_layer_ids": shared["aux_layer_ids"], "final_layer_id": shared["final_layer_id"],
        "hidden_size": shared["hidden_size"], "dtype": shared["dtype"],
        # what the target computed in (the files are in dtype; float32 is stored as bfloat16)
        "compute_dtype": shards[0][1].get("compute_dtype", shared["dtype"]),
        "mode": "offline", "storage": shared["storage"], "stored_dtype": shared["stored_dtype"],
        "target_digest": shared["target_digest"], "data_digest": shared["data_digest"],
        "rows": shared["dataset_rows"], "tokens": tokens, "bytes": size,
        "bytes_per_token": size / tokens if tokens else None,
        "backend": "+".join(backends),
        "store_key": shared["store_key"], "num_shards": shared["num_shards"],
        "files": files,
    }
    atomic_write_json(args.manifest, manifest)

    # The data dir's digest from digests already known: exactly what digests.path_digest
    # would compute by rehashing every file (it is the dir manifest's digest).
    data_dir_digest = manifest_digest({**other_digests, **{f"hidden_states/{n}": d for n, d in files.items()}})
    write_provenance(args, shards, shared, backends, data_dir_digest, counts)
    log.info("gathered %d rows, %d tokens, %.1f MB into %s (%d linked, %d copied)", manifest["rows"], tokens,
             size / 1e6, args.out_data, counts["linked"], counts["copied"])


def write_provenance(args, shards, shared, backends, data_dir_digest: str, counts: dict) -> None:
    settings = {k: shared[k] for k in ("aux_layer_ids", "dtype", "storage", "num_shards")} | {"backend": "+".join(backends)}
    settings["compute_dtype"] = shards[0][1].get("compute_dtype", shared["dtype"])
    prov = Provenance("hidden_states_gather", settings)
    # What the shards computed in and why (pipeline_lib/dtypes.py): each distinct record once.
    records = [s.get("dtype_resolution") for _, s in shards]
    resolutions = [r for i, r in enumerate(records) if r not in records[:i]]
    inputs = {f"shard_{s['shard']}": p for p, s in shards} | {"data": args.data, "token_freq": args.token_freq}
    # The data dir holds every hidden state: its digest comes from the known per-file digests
    # instead of rehashing gigabytes.
    prov.write(args.provenance, inputs=inputs, outputs={"manifest": args.manifest, "data": args.out_data},
               digests={"data": data_dir_digest},
               # How this run got the files (reused from the store or extracted) is history, not
               # content: here, not in the manifest, so an interrupted-then-resumed extraction
               # makes the same manifest as an uninterrupted one and nothing after it is stale.
               links=counts, store={"reused": sum(s["reused"] for _, s in shards),
                                    "regenerated": sum(s["regenerated"] for _, s in shards)},
               dtype_resolution=resolutions, parallel=parallel.of_shards([s for _, s in shards]))


if __name__ == "__main__":
    run_main(main)
