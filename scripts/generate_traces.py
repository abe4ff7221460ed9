#!/usr/bin/env python
"""Stage 3 (traces), one shard: the target answers its share of the training prompts.

    generate_traces.py --settings JSON --target DIR --manifest manifest.json \\
        --prompts train.jsonl --shard I --num-shards N --cache-dir DIR \\
        --out I-of-N.jsonl --summary I-of-N.summary.json

Sharding: shard I takes prompts[I::N] (strided: a prompt file grouped by source or length
spreads evenly over the shards); gather_traces.py interleaves the shards back into prompt order.

Turns (`generation.turns`): `first` answers each conversation's first user turn; `all` (up to
`max_turns`) answers every user turn in order, in rounds: round k sends turn k of every
conversation whose turn k-1 was answered, with the target's own earlier answers in context
(pipeline_lib/traces.py: the chat template renders or drops past reasoning as it does
for any client). A failed turn ends its conversation there. Every row counts its user turns
(`turns_total`) and those left unanswered (`turns_dropped`: not asked with `first` or past
max_turns, after a failed turn, or without a dataset answer), so no turn vanishes uncounted.

Answers (`generation.source`): `target` generates them; `dataset` takes the prompt set's own
assistant answers (prompt rows' `turns`) and starts no backend. A source in the prompt file
without any answer is an error naming it.

Row cache (resume): each finished turn is appended and fsync'd to CACHE_DIR/I-of-N.jsonl the
moment it is done. Turns are keyed by (prompt id, digest of the turn's request messages -
earlier answers included, generation key); the generation key digests what decides the answer:
max_tokens, temperature, top_p, seed, chat_template_kwargs, reasoning_parser and the target
(weights, tokenizer and chat-template digests from the manifest). Every shard reads every
cache file, so a rerun, a resumed failure or a num_shards change regenerates nothing finished
(a killed multi-turn job redoes only unfinished turns; `first` and `all` share first turns),
and any change to those settings misses the cache. Batch size, timeouts, retries, endpoint and
backend are not in the key: a row records the backend that made it, and switching backends
half-way keeps the finished rows. Delete the cache directory to regenerate everything.

Token ids: each turn keeps the ids the target emitted (`token_ids`; null where the backend
cannot return them), which tokenize splices into the training row instead of re-encoding text.

Failures: a prompt the backend rejects (e.g. longer than the context) becomes an error row and
is cached (the same settings would fail again); a prompt that still times out or meets a server
error after `retries` retries becomes an error row that is NOT cached, so a rerun retries it. A
backend that cannot serve at all (endpoint unreachable after the retries, credentials or model
name refused, engine dead, every prompt failing) fails the job; finished rows stay cached.

The declared outputs (--out in prompt order, --summary) are written atomically at the end.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, dtypes, runtime  # noqa: E402
from pipeline_lib.traces import TURN_FIELDS, count_rows, turn_messages  # noqa: E402
from pipeline_lib.digests import json_digest  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json, atomic_write_jsonl, read_jsonl  # noqa: E402
from pipeline_lib.row_cache import RowCache  # noqa: E402
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
    source: str | None = None
    # [{"user", "assistant"}] for every user turn (first included); None = one turn, no answer
    turns: list[dict[str, Any]] | None = None

    @property
    def users(self) -> list[str]:
        return [t["user"] for t in self.turns] if self.turns else [self.messages[-1]["content"]]

    def dataset_answer(self, k: int) -> str | None:
        """The source's own answer to user turn k (0-based), if it has one."""
        return self.turns[k]["assistant"] if self.turns else None


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
        turns = row.get("turns")
        if turns is not None and not (
                isinstance(turns, list) and turns and all(
                    isinstance(t, dict) and isinstance(t.get("user"), str)
                    and (t.get("assistant") is None or isinstance(t["assistant"], str)) for t in turns)
                and turns[0]["user"] == messages[-1]["content"]):
            raise PipelineError(f"{where}: prompt {pid!r}: 'turns' must be a list of {{\"user\": str, "
                                f"\"assistant\": str|null}} whose first user turn is the last message; "
                                f"regenerate the prompts file")
        source = row.get("source")
        prompts.append(Prompt(len(prompts), pid, messages, category if isinstance(category, str) else None,
                              source if isinstance(source, str) else None, turns))
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


def row_key(prompt: Prompt, gen_key: str, messages: list[dict[str, Any]] | None = None) -> str:
    """Cache key of one turn: the prompt's id and the turn's request messages (the first turn's
    are the prompt's own, so `turns: first` and `all` share first turns)."""
    return json_digest({"id": prompt.id, "messages": json_digest(prompt.messages if messages is None else messages),
                        "generation": gen_key})


# --------------------------------------------------------------------------- rows

DATASET = "dataset"  # the `backend` of rows whose answers come from the prompt set


def turn_record(completion, backend: str) -> dict[str, Any]:
    return {"reasoning": completion.reasoning, "answer": completion.answer,
            "finish_reason": completion.finish_reason, "error": completion.error,
            "prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "token_ids": completion.token_ids, "backend": backend}


def cached_turn(entry: dict[str, Any]) -> dict[str, Any]:
    """A turn record from a cache entry (rows cached before token ids were kept have none)."""
    return {**{k: entry.get(k) for k in TURN_FIELDS}, "backend": entry.get("backend")}


def dataset_turns(prompt: Prompt, wanted: int) -> list[dict[str, Any]]:
    """The prompt set's own answers to the first `wanted` user turns, up to the first turn
    without one (a first turn without one is an error row, counted and never trained on)."""
    records = []
    for k in range(wanted):
        answer = prompt.dataset_answer(k)
        if answer is None:
            if k == 0:
                records.append({**{f: None for f in TURN_FIELDS}, "finish_reason": "error", "prompt_tokens": 0,
                                "completion_tokens": 0, "backend": DATASET,
                                "error": f"generation.source = dataset: source {prompt.source!r} has no assistant "
                                         f"answer to this conversation's first user turn"})
            break
        records.append({**{f: None for f in TURN_FIELDS}, "answer": answer, "finish_reason": "stop",
                        "prompt_tokens": 0, "completion_tokens": 0, "backend": DATASET})
    return records


def check_dataset_answers(prompts: list[Prompt], path: Path) -> None:
    """generation.source = dataset needs answers: a prompt source with none at all is an error."""
    answered: dict[str, bool] = {}
    for p in prompts:
        answered[p.source or "?"] = answered.get(p.source or "?", False) or p.dataset_answer(0) is not None
    empty = sorted(src for src, ok in answered.items() if not ok)
    if empty:
        example = next(p.id for p in prompts if (p.source or "?") == empty[0])
        raise PipelineError(
            f"setting generation.source = dataset: prompt source(s) {empty} in {path} carry no assistant answers "
            f"(e.g. row {example!r}; MT-Bench has questions only, and a prompt file without answer fields has "
            f"none), so there is nothing to train on. Use generation.source: target, or a source whose "
            f"conversations include the assistant's replies (sharegpt/messages conversations, chitchat, a "
            f"prompt file with a 'completion' or 'response' column)")


def trace_row(prompt: Prompt, records: list[dict[str, Any]], sampling: dict[str, Any] | None) -> dict[str, Any]:
    """One row of traces.jsonl (docs/artifacts.md): the first turn at the top, later turns in
    `later_turns`, and the conversation's turn counts."""
    first = records[0]
    users = prompt.users
    return {"id": prompt.id, "messages": prompt.messages, **{k: first[k] for k in TURN_FIELDS},
            "later_turns": [{"user": users[k], **{f: r[f] for f in TURN_FIELDS}} for k, r in enumerate(records[1:], 1)],
            "turns_total": len(users), "turns_dropped": len(users) - len(records),
            "sampling": None if first["backend"] == DATASET else sampling, "backend": first["backend"],
            "category": prompt.category}


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


class TurnGenerator:
    """Asks the target for one round of turns: cached turns are reused, the rest generated
    (the backend and the cache file are opened on the first miss) and cached as they finish."""

    def __init__(self, settings, args, dtype: str, gen_key: str, cached: dict[str, dict], tag: str):
        from pipeline_lib.generation import RunCounts

        self.settings, self.args, self.dtype, self.gen_key, self.cached, self.tag = \
            settings, args, dtype, gen_key, cached, tag
        self.cache = RowCache(args.cache_dir, args.shard, args.num_shards)
        self.backend = None
        self.backend_info: dict[str, Any] = {"backend": settings.backend}
        self.reused = self.generated = self.cached_now = self.new_tokens = 0
        self.generate_s = 0.0
        self.counts = RunCounts()  # retries, failed attempts by kind and backoff waits of all rounds

    def _start(self) -> None:
        from pipeline_lib.generation import make_backend

        self.backend = make_backend(self.settings, self.args.target, self.dtype, log)
        self.cache.open()
        self.backend.start()
        self.backend_info = self.backend.describe()

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.cache.close()

    def round(self, turn: int, requests: dict[str, tuple[Prompt, list[dict]]]) -> dict[str, dict]:
        """{prompt id: turn record} for {prompt id: (prompt, request messages)} of user turn
        `turn` (1-based)."""
        from pipeline_lib.generation import PromptRequest, generate_with_retries

        keys = {pid: row_key(p, self.gen_key, messages) for pid, (p, messages) in requests.items()}
        done = {pid: cached_turn(self.cached[k]) for pid, k in keys.items() if k in self.cached}
        todo = [pid for pid in requests if pid not in done]
        self.reused += len(done)
        what = "prompts" if turn == 1 else f"conversations at user turn {turn}"
        log(f"{self.tag} {len(requests)} {what}: {len(done)} already in {self.args.cache_dir}, {len(todo)} to "
            f"generate with {self.settings.backend}")
        if not todo:
            return done
        if self.backend is None:
            self._start()
        # Request ids name the turn (a conversation has one request per turn).
        req_ids = {pid if turn == 1 else f"{pid}#turn{turn}": pid for pid in todo}
        t0 = time.time()

        def on_done(c) -> None:
            pid = req_ids[c.request.id]
            record = turn_record(c, self.backend.name)
            # Cache answers and prompts the backend rejected; not transient failures
            # (timeouts, server errors), which a rerun should try again.
            if c.ok or c.error_kind == "invalid":
                self.cache.append(keys[pid], self.gen_key, {"id": pid, "turn": turn, **record})
                self.cached_now += 1
            done[pid] = record
            self.new_tokens += c.completion_tokens
            if len(done) % 50 == 0:
                log(f"{self.tag} turn {turn}: {len(done)}/{len(requests)} done")

        counts = generate_with_retries(self.backend, [PromptRequest(rid, requests[pid][1])
                                                      for rid, pid in req_ids.items()],
                                       self.settings.retries, on_done, log)
        self.generate_s += time.time() - t0
        self.backend_info = self.backend.describe()  # again: backends add what they measured while generating
        self.generated += len(todo)
        self.counts.retried += counts.retried
        self.counts.attempt_errors.update(counts.attempt_errors)
        self.counts.waited_s += counts.waited_s
        return done


def answer_turns(prompts: list[Prompt], settings, gen: TurnGenerator) -> dict[str, list[dict]]:
    """Round k answers user turn k of every conversation whose turn k-1 was answered, its
    earlier answers in context; {prompt id: turn records}."""
    records: dict[str, list[dict]] = {p.id: [] for p in prompts}
    wanted = {p.id: settings.turns_to_answer(len(p.users)) for p in prompts}
    for k in range(max(wanted.values(), default=0)):
        active = [p for p in prompts if wanted[p.id] > k
                  and (k == 0 or records[p.id][-1]["finish_reason"] != "error")]
        if not active:
            break
        requests = {p.id: (p, turn_messages(p.messages, [(r["answer"], r["reasoning"]) for r in records[p.id]],
                                            p.users[1:k + 1])) for p in active}
        for pid, record in gen.round(k + 1, requests).items():
            records[pid].append(record)
    return records


def main() -> int:
    args = parse_args()
    started = time.time()
    runtime.setup()
    from pipeline_lib.generation import GenerationSettings

    settings = GenerationSettings.from_dict(args.settings)
    if not 0 <= args.shard < args.num_shards:
        raise PipelineError(f"--shard {args.shard} is outside 0..{args.num_shards - 1} "
                            f"(--num-shards {args.num_shards})")
    if not (args.target / "config.json").exists():
        raise PipelineError(f"{args.target}: not a model dir (no config.json); run the target stage first")
    manifest = load_manifest(args.manifest)
    stored = manifest.get("dtype")
    if stored not in ("bfloat16", "float16", "float32"):
        raise PipelineError(f"{args.manifest}: dtype {stored!r} is not bfloat16/float16/float32; rebuild the target")
    # generation.dtype (the workflow resolved `auto`: pipeline_lib/dtypes.py); unset, the stored dtype.
    dtype = settings.dtype or stored
    answer_defining = settings.answer_defining()
    if dtype != stored and settings.backend != "openai":  # the answers depend on it (in the stored dtype the key stays as before; an endpoint computes in its own)
        answer_defining["dtype"] = dtype
    gen_key = generation_key(answer_defining, manifest, args.manifest)

    all_prompts = load_prompts(args.prompts)
    prompts = shard_prompts(all_prompts, args.shard, args.num_shards)
    tag = f"[traces {args.shard}/{args.num_shards}]"
    gen = None
    if settings.source == DATASET:
        check_dataset_answers(all_prompts, args.prompts)  # all sources, not just this shard's rows
        records = {p.id: dataset_turns(p, settings.turns_to_answer(len(p.users))) for p in prompts}
        log(f"{tag} {len(prompts)} prompts: answers taken from the prompt set (generation.source = dataset)")
    else:
        cached, skipped = RowCache(args.cache_dir, args.shard, args.num_shards).load()
        if skipped:
            log(f"{tag} {skipped} unreadable cache line(s) ignored")
        gen = TurnGenerator(settings, args, dtype, gen_key, cached, tag)
        try:
            records = answer_turns(prompts, settings, gen)
        except PipelineError as err:
            raise PipelineError(f"{err}\nFinished turns stay in the row cache {args.cache_dir} ({gen.cached_now} "
                                f"from this run); rerunning this shard resumes after them") from None
        finally:
            gen.close()

    sampling = settings.sampling()
    ordered = [trace_row(p, records[p.id], sampling) for p in prompts]
    atomic_write_jsonl(args.out, ordered)
    gen_s = gen.generate_s if gen else 0.0
    summary = {
        "shard": args.shard, "num_shards": args.num_shards, **count_rows(ordered),
        "turns": settings.turns, "max_turns": settings.max_turns, "source": settings.source,
        "reused": gen.reused if gen else 0, "generated": gen.generated if gen else 0,
        "retried": gen.counts.retried if gen else 0,
        # Every failed attempt of this run, retried or final, by kind: what the backend went through.
        "attempt_errors": dict(sorted(gen.counts.attempt_errors.items())) if gen else {},
        "retry_wait_s": round(gen.counts.waited_s, 3) if gen else 0.0,
        "wall_s": round(time.time() - started, 3), "generate_s": round(gen_s, 3),
        "new_completion_tokens": gen.new_tokens if gen else 0,
        "tokens_per_s": round(gen.new_tokens / gen_s, 1) if gen_s else None,
        "generation_key": gen_key, "settings": settings.public(),
        "dtype_resolution": dtypes.job_record("generation", dtype),
        **(gen.backend_info if gen else {"backend": DATASET}),
        "cache": str(RowCache(args.cache_dir, args.shard, args.num_shards).path),
    }
    atomic_write_json(args.summary, summary)
    log(f"{tag} wrote {len(ordered)} rows to {args.out}: {summary['ok']} ok ({summary['truncated']} truncated), "
        f"{summary['failed']} failed; turns: {summary['turns_answered']} answered, {summary['turns_failed']} failed, "
        f"{summary['turns_dropped']} of {summary['turns_total']} dropped (generation.turns = {settings.turns}); "
        f"{summary['reused']} reused, {summary['generated']} generated in {gen_s:.1f}s "
        f"({summary['tokens_per_s'] or 0} tok/s)")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: keep the entry point guarded
    run_main(main)
