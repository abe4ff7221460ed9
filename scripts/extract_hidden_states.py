#!/usr/bin/env python
"""Extract the target's hidden states for one shard of the tokenized dataset.

Shard i of n owns a contiguous row range. Each row's file goes to
  STORE_DIR/<key>/hs_{row}.safetensors   (token_ids int64 [T], hidden_states [T, n_aux+1, H],
                                          + hidden_states_scales [T, 1, 1] with storage fp8)
where <key> digests the target weights, the tokenized data, the layer ids and the dtype.
Existing files in the range are validated (readable, token ids, shape, dtype, finite values);
only missing or bad ones are regenerated. --out records what happened (reused/regenerated
counts, tokens, bytes, tokens/s, per-file digests) for gather_hidden_states.py.

    python scripts/extract_hidden_states.py --settings '{"backend": "vllm"}' \\
        --target R/target/model --manifest R/target/manifest.json --data R/tokenized/data \\
        --shard 0 --num-shards 1 --store-dir R/hidden_states/store --out R/hidden_states/shards/0-of-1.json

Settings (config.yaml `hidden_states`): backend (vllm|transformers), aux_layer_ids (null =
speculators' default [2, N//2, N-3]), batch_size and batch_tokens (the transformers backend's
forward passes: at most this many rows and padded tokens; vLLM schedules its own batches),
dtype (what the target computes in; bf16 storage writes float32 as bfloat16), storage (bf16 |
fp8: hs-connectors' per-token scaled float8 files, about half the bytes), trust_remote_code.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, dtypes, parallel, runtime  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.hidden_states import (  # noqa: E402
    FileRecord, HSStore, LayerSpec, Row, backend_class, hs_name, layer_spec, log_to_stderr, shard_range, store_key,
)
from pipeline_lib.io import atomic_write_json, free_bytes, reporting_disk_full, require_free_space  # noqa: E402
from pipeline_lib.provenance import upstream_digest  # noqa: E402
from pipeline_lib.target import loaded_weights_digest  # noqa: E402

log = logging.getLogger("extract_hidden_states")
PROGRESS_EVERY_S = 30


def parse_args():
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, type=Path, help="materialized target model dir (HF format)")
    p.add_argument("--manifest", required=True, type=Path, help="target manifest.json (its weights_digest)")
    p.add_argument("--data", required=True, type=Path, help="tokenized dataset dir (datasets save_to_disk)")
    p.add_argument("--shard", required=True, type=int, help="this shard's index, 0-based")
    p.add_argument("--num-shards", required=True, type=int)
    p.add_argument("--store-dir", required=True, type=Path, help="root of the hidden-states file store")
    p.add_argument("--out", required=True, type=Path, help="shard summary json to write")
    return p.parse_args()


def load_rows(data_dir: Path, shard: int, num_shards: int) -> tuple[int, range, list[Row]]:
    """(total rows, this shard's range, its rows) from speculators' tokenized dataset."""
    import datasets

    if not (data_dir / "state.json").exists():
        raise PipelineError(f"{data_dir}: not a datasets save_to_disk dir (no state.json); rerun the tokenize rule")
    ds = datasets.load_from_disk(str(data_dir)).with_format(None)
    if "input_ids" not in ds.column_names:
        raise PipelineError(f"{data_dir}: no input_ids column (columns: {ds.column_names}); "
                            f"it must be speculators' format (input_ids, loss_mask, seq_len)")
    start, stop = shard_range(len(ds), shard, num_shards)
    rows = []
    for offset, ids in enumerate(ds.select(range(start, stop))["input_ids"]):
        if not ids:
            raise PipelineError(f"{data_dir}: row {start + offset} has no tokens; drop empty rows when tokenizing")
        rows.append(Row(start + offset, list(ids)))
    return len(ds), range(start, stop), rows


def check_existing(store: HSStore, rows: list[Row]) -> tuple[dict[int, FileRecord], list[Row], dict[str, str]]:
    """(records of valid files, rows to generate, {row: why its file was invalid})."""
    records, todo, invalid = {}, [], {}
    for row in rows:
        result = store.check(row)
        if isinstance(result, FileRecord):
            records[row.index] = result
            continue
        todo.append(row)
        if result != "missing":
            invalid[str(row.index)] = result
            log.warning("row %d: existing %s is invalid (%s); regenerating", row.index, hs_name(row.index), result)
    return records, todo, invalid


def generate(backend_cls, args, spec: LayerSpec, settings: dict, store: HSStore,
             todo: list[Row]) -> tuple[list[FileRecord], float, float]:
    """Run the backend over `todo`: (records, engine/model start seconds, extraction seconds)."""
    too_long = [r.index for r in todo if spec.max_positions and len(r.input_ids) > spec.max_positions]
    if too_long:
        raise PipelineError(f"{args.data}: rows {too_long[:10]} are longer than the target's "
                            f"max_position_embeddings ({spec.max_positions}); lower tokenize.max_seq_len")
    t0 = time.monotonic()
    backend = backend_cls(args.target, spec, settings, max(len(r.input_ids) for r in todo))
    t1 = last_report = time.monotonic()
    records = []
    try:
        for record in backend.extract(todo, store):
            records.append(record)
            if time.monotonic() - last_report > PROGRESS_EVERY_S:
                last_report = time.monotonic()
                log.info("%d/%d rows extracted (%.0f s)", len(records), len(todo), last_report - t1)
    finally:
        backend.close()
    return records, t1 - t0, time.monotonic() - t1


def main() -> None:
    args = parse_args()
    runtime.setup()
    log_to_stderr()
    settings = args.settings
    backend_name = settings.get("backend", "vllm")
    backend_cls = backend_class(backend_name)  # an unknown name fails before anything is loaded
    if args.num_shards < 1:
        raise PipelineError(f"--num-shards {args.num_shards}: must be at least 1 (hidden_states.num_shards)")
    shard_range(0, args.shard, args.num_shards)  # a bad --shard fails before the data is read

    spec = layer_spec(args.target, settings)
    t_digest = loaded_weights_digest(args.target, args.manifest)
    d_digest = upstream_digest(args.data)
    total_rows, row_range, rows = load_rows(args.data, args.shard, args.num_shards)
    key = store_key(t_digest, d_digest, spec)
    store = HSStore(args.store_dir / key, spec)
    log.info("shard %d/%d: rows %d..%d of %d, layers %s, store %s", args.shard, args.num_shards,
             row_range.start, row_range.stop, total_rows, spec.layer_ids, store.root)

    removed = store.clean_temps(row_range)
    if removed:
        log.info("removed %d temp file(s) left by an interrupted run: %s", len(removed), removed[:5])
    records, todo, invalid = check_existing(store, rows)
    reused = len(records)
    log.info("%d file(s) valid and reused, %d to generate (%d invalid)", reused, len(todo), len(invalid))
    startup_s = extract_s = 0.0
    if todo:
        expected = sum(spec.file_bytes(len(r.input_ids)) for r in todo)
        what = f"the hidden states of {len(todo)} row(s) of shard {args.shard} of {args.num_shards}"
        require_free_space(store.root, expected, what)
        log.info("disk: %s need about %d bytes; %d free under %s", what, expected, free_bytes(store.root), store.root)
        try:
            with reporting_disk_full(store.root, what, expected, min(spec.file_bytes(len(r.input_ids)) for r in todo),
                                     "finished files are validated and reused, the rest is extracted"):
                new, startup_s, extract_s = generate(backend_cls, args, spec, settings, store, todo)
        finally:
            store.clean_temps(row_range)  # a failed write's temp files: their space back now
        records.update((rec.row, rec) for rec in new)
    missing = [r.index for r in rows if r.index not in records]
    if missing:
        raise RuntimeError(f"backend {backend_name} produced no file for rows {missing[:10]}")

    ordered = [records[r.index] for r in rows]
    new_tokens = sum(len(r.input_ids) for r in todo)
    tokens = sum(rec.tokens for rec in ordered)
    size = sum(rec.bytes for rec in ordered)
    summary = {
        "shard": args.shard, "num_shards": args.num_shards, "row_range": [row_range.start, row_range.stop],
        "dataset_rows": total_rows,
        "aux_layer_ids": list(spec.aux_layer_ids), "final_layer_id": spec.final_layer_id,
        "hidden_size": spec.hidden_size, "dtype": spec.dtype, "compute_dtype": spec.run_dtype,
        "dtype_resolution": dtypes.job_record("hidden_states", spec.run_dtype),
        "storage": spec.storage, "stored_dtype": spec.format.stored_dtype(spec.dtype),
        "target_digest": t_digest, "data_digest": d_digest,
        "store_key": key, "store_dir": str(store.root),
        "backend": backend_name,
        "parallel": parallel.decisions(),  # the engine's layout over the job's GPUs (vllm backend)
        "rows": len(rows), "tokens": tokens, "bytes": size,
        "bytes_per_token": size / tokens if tokens else None,
        "reused": reused, "regenerated": len(todo), "invalid": invalid, "removed_temp_files": len(removed),
        "regenerated_tokens": new_tokens,
        "startup_s": round(startup_s, 3), "extract_s": round(extract_s, 3),
        "tokens_per_s": round(new_tokens / extract_s, 1) if extract_s > 0 else None,
        "files": {hs_name(rec.row): rec.digest for rec in ordered},
        "file_bytes": {hs_name(rec.row): rec.bytes for rec in ordered},
    }
    atomic_write_json(args.out, summary)
    log.info("shard %d: %d rows, %d tokens, %.1f MB; reused %d, regenerated %d%s", args.shard, len(rows), tokens,
             size / 1e6, reused, len(todo),
             f" at {summary['tokens_per_s']} tokens/s" if summary["tokens_per_s"] else "")


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard keeps them from rerunning main
    run_main(main)
