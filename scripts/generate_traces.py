#!/usr/bin/env python
"""Stage 3 (traces), one shard: the target answers its share of the training prompts.

    generate_traces.py --settings JSON --target DIR --manifest manifest.json \\
        --prompts train.jsonl --shard I --num-shards N --cache-dir DIR \\
        --out I-of-N.jsonl --summary I-of-N.summary.json

Sharding: shard I takes prompts[I::N] (strided: a prompt file grouped by source or length
spreads evenly over the shards); gather_traces.py interleaves the shards back into prompt order.

Row cache (resume): each finished row is appended and fsync'd to CACHE_DIR/I-of-N.jsonl the
moment it is done. Rows are keyed by (prompt id, digest of the prompt messages, generation key);
the generation key digests what decides the answer: max_tokens, temperature, top_p, seed,
chat_template_kwargs, reasoning_parser and the target (weights, tokenizer and chat-template
digests from the manifest). Every shard reads every cache file, so a rerun, a resumed failure or
a num_shards change regenerates nothing finished, and any change to those settings misses the
cache. Batch size, timeouts, retries, endpoint and backend are not in the key: a row records
the backend that made it, and switching backends half-way keeps the finished rows. Delete the
cache directory to regenerate everything.

Failures: a prompt the backend rejects (e.g. longer than the context) becomes an error row and
is cached (the same settings would fail again); a prompt that still times out or meets a server
error after `retries` retries becomes an error row that is NOT cached, so a rerun retries it. A
backend that cannot serve at all (endpoint unreachable after the retries, credentials or model
name refused, engine dead, every prompt failing) fails the job; finished rows stay cached.

The declared outputs (--out in prompt order, --summary) are written atomically at the end.
"""
from __future__ import annotations

import fcntl
import json
from collections import Counter
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.digests import json_digest  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import append_jsonl_durable, atomic_write_json, atomic_write_jsonl, read_jsonl  # noqa: E402
from pipeline_lib.target import load_manifest  # noqa: E402

ROLES = ("system", "user", "assistant")
# Manifest digests that define the target for the cache key (weights_digest is required).
TARGET_DIGESTS = ("weights_digest", "tokenizer_digest", "chat_template_digest")


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- prompts

@dataclass(frozen=True)
class Prompt:
    index: int  # position in the prompts file
    id: str
    messages: list[dict[str, Any]]
    category: str | None


def load_prompts(path: Path) -> list[Prompt]:
    if not path.exists():
        raise PipelineError(f"{path}: prompts file not found; run the prompts stage first")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, row in read_jsonl(path):
        where = f"{path}:{lineno}"
        pid = row.get("id")
        if not isinstance(pid, str) or not pid:
            raise PipelineError(f"{where}: row has no string 'id'; prompt rows need "
                                f'{{"id", "messages", "category", "source"}} (see docs/artifacts.md)')
        if pid in seen:
            raise PipelineError(f"{where}: duplicate prompt id {pid!r} (first on line {seen[pid]}); "
                                f"ids must be unique, regenerate the prompts file")
        seen[pid] = lineno
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PipelineError(f"{where}: prompt {pid!r} has no 'messages' list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise PipelineError(f"{where}: prompt {pid!r} message {i} must be "
                                    f'{{"role": one of {list(ROLES)}, "content": str}}, got {str(m)[:200]}')
        if messages[-1]["role"] != "user":
            raise PipelineError(f"{where}: prompt {pid!r} ends with a {messages[-1]['role']!r} message; the "
                                f"last message must be the user turn the target answers")
        category = row.get("category")
        prompts.append(Prompt(len(prompts), pid, messages, category if isinstance(category, str) else None))
    if not prompts:
        raise PipelineError(f"{path}: no prompts; check the prompts stage's source and num_samples")
    return prompts


def shard_prompts(prompts: list[Prompt], shard: int, num_shards: int) -> list[Prompt]:
    return prompts[shard::num_shards]


# --------------------------------------------------------------------------- row cache

def generation_key(settings: dict[str, Any], manifest: dict[str, Any], manifest_path: Path) -> str:
    if not manifest.get("weights_digest"):
        raise PipelineError(f"{manifest_path}: no weights_digest; rebuild the target (materialize_target.py)")
    target = {k: manifest.get(k) for k in TARGET_DIGESTS}
    return json_digest({"settings": settings, "target": target})


def row_key(prompt: Prompt, gen_key: str) -> str:
    return json_digest({"id": prompt.id, "messages": json_digest(prompt.messages), "generation": gen_key})


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


# --------------------------------------------------------------------------- rows

def trace_row(prompt: Prompt, completion, sampling: dict[str, Any], backend: str) -> dict[str, Any]:
    """One row of traces.jsonl (docs/artifacts.md)."""
    return {"id": prompt.id, "messages": prompt.messages, "reasoning": completion.reasoning,
            "answer": completion.answer, "finish_reason": completion.finish_reason, "error": completion.error,
            "prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "sampling": sampling, "backend": backend, "category": prompt.category}


def reused_row(prompt: Prompt, cached: dict[str, Any]) -> dict[str, Any]:
    # The key covers id and messages, not the category label: take that from today's prompt.
    return {**cached, "id": prompt.id, "messages": prompt.messages, "category": prompt.category}


def count_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from pipeline_lib.generation import error_label

    return {"rows": len(rows),
            "ok": sum(r["finish_reason"] != "error" for r in rows),
            "failed": sum(r["finish_reason"] == "error" for r in rows),
            "truncated": sum(r["finish_reason"] == "length" for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "failed_by_error": dict(sorted(Counter(error_label(r["error"]) for r in rows
                                                   if r["finish_reason"] == "error").items()))}


# --------------------------------------------------------------------------- main

def parse_args():
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, type=Path, help="materialized target model dir")
    p.add_argument("--manifest", required=True, type=Path, help="target/manifest.json (digests, dtype)")
    p.add_argument("--prompts", required=True, type=Path, help="prompts/train.jsonl")
    p.add_argument("--shard", required=True, type=int, help="this shard's index, 0-based")
    p.add_argument("--num-shards", required=True, type=int, help="number of shards")
    p.add_argument("--cache-dir", required=True, type=Path, help="row cache shared by all shards and reruns")
    p.add_argument("--out", required=True, type=Path, help="this shard's trace rows (jsonl, prompt order)")
    p.add_argument("--summary", required=True, type=Path, help="this shard's summary (json)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    started = time.time()
    runtime.setup()
    from pipeline_lib.generation import (Completion, GenerationSettings, PromptRequest, generate_with_retries,
                                         make_backend)

    settings = GenerationSettings.from_dict(args.settings)
    if not 0 <= args.shard < args.num_shards:
        raise PipelineError(f"--shard {args.shard} is outside 0..{args.num_shards - 1} "
                            f"(--num-shards {args.num_shards})")
    if not (args.target / "config.json").exists():
        raise PipelineError(f"{args.target}: not a model dir (no config.json); run the target stage first")
    manifest = load_manifest(args.manifest)
    dtype = manifest.get("dtype")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise PipelineError(f"{args.manifest}: dtype {dtype!r} is not bfloat16/float16/float32; rebuild the target")
    gen_key = generation_key(settings.answer_defining(), manifest, args.manifest)

    prompts = shard_prompts(load_prompts(args.prompts), args.shard, args.num_shards)
    cache = RowCache(args.cache_dir, args.shard, args.num_shards)
    cached, skipped = cache.load()
    keys = {p.id: row_key(p, gen_key) for p in prompts}
    rows: dict[str, dict] = {p.id: reused_row(p, cached[keys[p.id]]) for p in prompts if keys[p.id] in cached}
    todo = [p for p in prompts if p.id not in rows]
    tag = f"[traces {args.shard}/{args.num_shards}]"
    log(f"{tag} {len(prompts)} prompts: {len(rows)} already in {args.cache_dir}, {len(todo)} to generate "
        f"with {settings.backend}" + (f" ({skipped} unreadable cache line(s) ignored)" if skipped else ""))

    backend_info: dict[str, Any] = {"backend": settings.backend}
    counts = None
    gen_s = 0.0
    new_tokens = 0
    cached_now = 0  # rows this run appended to the cache
    if todo:
        by_id = {p.id: p for p in todo}
        sampling = settings.sampling()
        backend = make_backend(settings, args.target, dtype, log)
        cache.open()
        try:
            backend.start()
            backend_info = backend.describe()
            t0 = time.time()

            def on_done(c: Completion) -> None:
                nonlocal new_tokens, cached_now
                prompt = by_id[c.request.id]
                row = trace_row(prompt, c, sampling, backend.name)
                # Cache answers and prompts the backend rejected; not transient failures
                # (timeouts, server errors), which a rerun should try again.
                if c.ok or c.error_kind == "invalid":
                    cache.append(keys[prompt.id], gen_key, row)
                    cached_now += 1
                rows[prompt.id] = row
                new_tokens += c.completion_tokens
                if len(rows) % 50 == 0:
                    log(f"{tag} {len(rows)}/{len(prompts)} rows done")

            counts = generate_with_retries(backend, [PromptRequest(p.id, p.messages) for p in todo],
                                           settings.retries, on_done, log)
            gen_s = time.time() - t0
            backend_info = backend.describe()  # again: backends add what they measured while generating
        except PipelineError as err:
            raise PipelineError(f"{err}\nFinished rows stay in the row cache {args.cache_dir} ({cached_now} from this "
                                f"run); rerunning this shard resumes after them") from None
        finally:
            backend.close()
            cache.close()

    ordered = [rows[p.id] for p in prompts]
    atomic_write_jsonl(args.out, ordered)
    summary = {
        "shard": args.shard, "num_shards": args.num_shards, **count_rows(ordered),
        "reused": len(prompts) - len(todo), "generated": len(todo),
        "retried": counts.retried if counts else 0,
        # Every failed attempt of this run, retried or final, by kind: what the backend went through.
        "attempt_errors": dict(sorted(counts.attempt_errors.items())) if counts else {},
        "retry_wait_s": round(counts.waited_s, 3) if counts else 0.0,
        "wall_s": round(time.time() - started, 3), "generate_s": round(gen_s, 3),
        "new_completion_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / gen_s, 1) if gen_s else None,
        "generation_key": gen_key, "settings": settings.public(), **backend_info,
        "cache": str(cache.path),
    }
    atomic_write_json(args.summary, summary)
    log(f"{tag} wrote {len(ordered)} rows to {args.out}: {summary['ok']} ok ({summary['truncated']} truncated), "
        f"{summary['failed']} failed, {summary['reused']} reused, {summary['generated']} generated in "
        f"{gen_s:.1f}s ({summary['tokens_per_s'] or 0} tok/s)")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: keep the entry point guarded
    run_main(main)
