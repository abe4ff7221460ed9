#!/usr/bin/env python
"""Stage synthesize, one shard: the target writes user requests (the Magpie method).

    synthesize_prompts.py --settings JSON --target DIR --manifest manifest.json \\
        --shard I --num-shards N --cache-dir DIR --out I-of-N.jsonl --summary I-of-N.summary.json

Candidate i (0 <= i < synthesize.num_prompts; shard I takes i = I, I+N, ...) is the target's
chat template rendered up to the opening of a user turn - with the system prompt of topic
i % len(topics), or synthesize.system_prompt, or none (the template's own default) - sent as
token ids through the raw-prompt path of the generation backends (vllm or transformers) with a
sampling seed of its own; the model writes until it ends its turn (or max_tokens). The text is
the candidate request; gather_synthesized.py filters them all.

Row cache (resume, as the traces stage): each finished candidate is appended and fsync'd to
CACHE_DIR/I-of-N.jsonl at once, keyed by its index, its prompt's token ids and what decides
the text (max_tokens, temperature, top_p, seed, the target's weights/tokenizer/template
digests). Every shard reads every cache file, so a rerun, a resumed failure or a num_shards
or num_prompts change regenerates nothing finished. Transient failures are not cached.

Each row: {index, id, topic, text, finish_reason, error, completion_tokens,
special_tokens_emitted (special token ids it emitted before its end of turn), backend}.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.digests import json_digest  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json, atomic_write_jsonl  # noqa: E402
from pipeline_lib.row_cache import RowCache  # noqa: E402
from pipeline_lib.target import load_manifest  # noqa: E402

TARGET_DIGESTS = ("weights_digest", "tokenizer_digest", "chat_template_digest")
ROW_FIELDS = ("index", "id", "topic", "text", "finish_reason", "error", "completion_tokens",
              "special_tokens_emitted", "backend")


def log(msg: str) -> None:
    print(msg, flush=True)


def candidate_id(index: int) -> str:
    return f"synth-{index:07d}"


def candidate_row(index: int, topic: str | None, completion: Any, special: set[int], backend: str) -> dict:
    ids = completion.token_ids or []
    if completion.finish_reason == "stop" and ids:
        ids = ids[:-1]  # the end-of-turn token that ended it
    return {"index": index, "id": candidate_id(index), "topic": topic, "text": (completion.answer or "").strip(),
            "finish_reason": completion.finish_reason, "error": completion.error,
            "completion_tokens": completion.completion_tokens,
            "special_tokens_emitted": sum(t in special for t in ids), "backend": backend}


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, type=Path, help="materialized target model dir")
    p.add_argument("--manifest", required=True, type=Path, help="target/manifest.json (digests, dtype)")
    p.add_argument("--shard", required=True, type=int)
    p.add_argument("--num-shards", required=True, type=int)
    p.add_argument("--cache-dir", required=True, type=Path, help="row cache shared by all shards and reruns")
    p.add_argument("--out", required=True, type=Path, help="this shard's candidates (jsonl, index order)")
    p.add_argument("--summary", required=True, type=Path, help="this shard's summary (json)")
    args = p.parse_args()
    started = time.time()
    runtime.setup()
    from transformers import AutoTokenizer

    from pipeline_lib.generation import PromptRequest, generate_with_retries, make_backend
    from pipeline_lib.synthesis import SynthesisSettings, special_token_ids, template_markers, user_turn_prefix

    s = SynthesisSettings.from_dict(args.settings)
    if not 0 <= args.shard < args.num_shards:
        raise PipelineError(f"--shard {args.shard} is outside 0..{args.num_shards - 1}")
    if not (args.target / "config.json").exists():
        raise PipelineError(f"{args.target}: not a model dir (no config.json); run the target stage first")
    manifest = load_manifest(args.manifest)
    if not manifest.get("weights_digest"):
        raise PipelineError(f"{args.manifest}: no weights_digest; rebuild the target (materialize_target.py)")
    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=s.trust_remote_code)
    special = special_token_ids(tokenizer)
    gen_key = json_digest({"sampling": s.sampling(), "target": {k: manifest.get(k) for k in TARGET_DIGESTS}})

    prefixes: dict[str | None, list[int]] = {}
    wanted: dict[int, tuple[list[int], str]] = {}  # index -> (prompt ids, cache key)
    for i in range(args.shard, s.num_prompts, args.num_shards):
        system = s.system_prompt_for(i)
        if system not in prefixes:
            prefixes[system] = user_turn_prefix(tokenizer, system, s.chat_template_kwargs)[1]
        ids = prefixes[system]
        wanted[i] = (ids, json_digest({"index": i, "prompt": json_digest(ids), "generation": gen_key}))

    tag = f"[synthesize {args.shard}/{args.num_shards}]"
    cache = RowCache(args.cache_dir, args.shard, args.num_shards)
    cached, skipped = cache.load()
    if skipped:
        log(f"{tag} {skipped} unreadable cache line(s) ignored")
    rows = {i: cached[key] for i, (_, key) in wanted.items() if key in cached}
    todo = [i for i in wanted if i not in rows]
    log(f"{tag} {len(wanted)} candidates: {len(rows)} already in {args.cache_dir}, {len(todo)} to generate with "
        f"{s.backend}")
    backend, info, counts, generate_s, cached_now = None, {"backend": s.backend}, None, 0.0, 0
    if todo:
        backend = make_backend(s.generation(), args.target, manifest["dtype"], log)
        cache.open()
        try:
            backend.start()
            requests = [PromptRequest(candidate_id(i), [], prompt_token_ids=wanted[i][0], seed=s.request_seed(i))
                        for i in todo]
            t0 = time.time()

            def on_done(c) -> None:
                nonlocal cached_now
                i = int(c.request.id.rsplit("-", 1)[1])
                topic = s.topic(i)
                row = candidate_row(i, topic.name if topic else None, c, special, backend.name)
                if c.ok or c.error_kind == "invalid":
                    cache.append(wanted[i][1], gen_key, row)
                    cached_now += 1
                rows[i] = row
                if len(rows) % 100 == 0:
                    log(f"{tag} {len(rows)}/{len(wanted)} done")

            try:
                counts = generate_with_retries(backend, requests, s.retries, on_done, log)
            except PipelineError as err:
                raise PipelineError(f"{err}\nFinished candidates stay in the row cache {args.cache_dir} "
                                    f"({cached_now} from this run); rerunning this shard resumes after them") from None
            generate_s = time.time() - t0
            info = backend.describe()
        finally:
            backend.close()
            cache.close()

    ordered = [rows[i] for i in sorted(wanted)]
    atomic_write_jsonl(args.out, ordered)
    new_tokens = sum(r["completion_tokens"] for i, r in rows.items() if i in todo)
    summary = {
        "shard": args.shard, "num_shards": args.num_shards, "rows": len(ordered),
        "ok": sum(r["finish_reason"] != "error" for r in ordered),
        "failed": sum(r["finish_reason"] == "error" for r in ordered),
        "reused": len(wanted) - len(todo), "generated": len(todo),
        "retried": counts.retried if counts else 0,
        "generation_key": gen_key, "settings": s.public(), **info,
        # The tokenizer's special tokens: a request spelling one out carries template markup.
        "template_markers": template_markers(tokenizer),
        # The rendered prompt per system prompt (null: the template's own default).
        "prompt_prefixes": [{"system_prompt": k, "prompt": tokenizer.decode(v)} for k, v in prefixes.items()],
        "wall_s": round(time.time() - started, 3), "generate_s": round(generate_s, 3),
        "new_completion_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / generate_s, 1) if generate_s else None,
        "cache": str(cache.path),
    }
    atomic_write_json(args.summary, summary)
    log(f"{tag} wrote {len(ordered)} candidates to {args.out}: {summary['ok']} ok, {summary['failed']} failed; "
        f"{summary['reused']} reused, {summary['generated']} generated in {generate_s:.1f}s")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: keep the entry point guarded
    run_main(main)
