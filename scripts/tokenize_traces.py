#!/usr/bin/env python
"""Stage 4 (rule `tokenize`): turn the target's traces into speculators' training data.

Each trace row (a conversation: prompt messages, then the target's reasoning and answer to
each user turn it answered) is rendered with the target's chat template. The loss mask covers
exactly the tokens the target generated, in every answered turn, and nothing else.

Tokens: each turn's prompt part is its request rendered with add_generation_prompt=True (the
context the target saw: earlier answers as pipeline_lib/traces.py puts them back). The answer
part is the token ids the target emitted (`token_ids`, end-of-turn token included when it
stopped), spliced in as they are. Where a turn has no ids (the prompt set's own answers,
servers that do not return them) its text is re-encoded: what follows the prompt in the render
with the answer, up to and including the end-of-turn token, and nothing of the template's
suffix; a turn cut at max_tokens ends where its text ended (no closing think tag, no
end-of-turn token); a row cut before any visible text is dropped and counted. stats.json
counts turns spliced and re-encoded, spliced turns whose text would re-encode to other tokens
(`reencode_differs`: what re-encoding would have trained wrongly), and re-encoded answers whose
text does not survive encode/decode (`roundtrip_differs`).

Multi-turn rows: a conversation is one training row while each turn's prompt starts with the
row so far (the earlier turns exactly as the target produced them); where the chat template
re-renders an earlier answer differently (a template that drops past reasoning, or text that
re-encodes to other tokens), the next turn starts a new row, so every masked token follows
exactly the context the target saw. A failed later turn ends the conversation.

Reasoning placement (re-encoded turns): the assistant message carries `reasoning_content`;
when the template ignores that field, the reasoning is inlined as
`<think>\\n{reasoning}\\n</think>\\n\\n{answer}`. stats.json records which one was used.

Settings (config `tokenize`): max_seq_len, overlength (truncate|drop), drop_failed,
trust_remote_code, chat_template_kwargs (the ones generation used).

    python scripts/tokenize_traces.py --settings '{"max_seq_len": 1024}' --target R/target/model \\
        --manifest R/target/manifest.json --traces R/traces/traces.jsonl --out-data R/tokenized/data \\
        --token-freq R/tokenized/token_freq.pt --stats R/tokenized/stats.json \\
        --provenance R/tokenized/provenance.json
"""
from __future__ import annotations

import io
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_dir, atomic_write_bytes, atomic_write_json, read_jsonl  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.target import chat_template_digest, load_manifest, tokenizer_digest  # noqa: E402
from pipeline_lib.traces import FINISH_REASONS, turn_messages  # noqa: E402
PROBE_REASONING = "pipeline-probe-reasoning-7f3a"


def inline_reasoning(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


@dataclass
class Turn:
    """One answered user turn: the messages of its request (the context the target saw) and
    what the target generated."""
    messages: list[dict]
    reasoning: str | None
    answer: str | None
    finish_reason: str
    token_ids: list[int] | None
    prompt_tokens: int = 0


@dataclass
class TraceRow:
    id: str
    where: str                      # "traces.jsonl:LINE", for messages
    messages: list[dict]
    reasoning: str | None
    answer: str | None
    finish_reason: str
    error: str | None
    token_ids: list[int] | None = None
    prompt_tokens: int = 0
    later_turns: list[dict] = field(default_factory=list)

    @classmethod
    def parse(cls, row: dict, where: str) -> "TraceRow":
        missing = [k for k in ("id", "messages", "finish_reason") if k not in row]
        if missing:
            raise PipelineError(f"{where}: trace row lacks {', '.join(missing)} (format: docs/artifacts.md); "
                                f"rerun the traces stage")
        later = row.get("later_turns") or []
        for turn in [row, *later]:
            if turn.get("finish_reason") not in FINISH_REASONS:
                raise PipelineError(f"{where}: row {row['id']}: finish_reason {turn.get('finish_reason')!r} is not "
                                    f"one of {sorted(FINISH_REASONS)}")
            ids = turn.get("token_ids")
            if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
                raise PipelineError(f"{where}: row {row['id']}: token_ids must be a list of integers or null")
        if not all(isinstance(t, dict) and isinstance(t.get("user"), str) for t in later):
            raise PipelineError(f"{where}: row {row['id']}: each of later_turns needs its 'user' text")
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise PipelineError(f"{where}: row {row['id']}: 'messages' must be a non-empty list of "
                                f"{{role, content}} objects")
        return cls(id=str(row["id"]), where=where, messages=messages, reasoning=row.get("reasoning") or None,
                   answer=row.get("answer"), finish_reason=row["finish_reason"], error=row.get("error"),
                   token_ids=row.get("token_ids"), prompt_tokens=int(row.get("prompt_tokens") or 0),
                   later_turns=later)

    def turns(self) -> tuple[list[Turn], int]:
        """(the answered turns in order, each with its request context; later turns that failed
        and so ended the conversation)."""
        out = [Turn(self.messages, self.reasoning, self.answer, self.finish_reason, self.token_ids,
                    self.prompt_tokens)]
        for k, t in enumerate(self.later_turns, 1):
            if t["finish_reason"] == "error":
                return out, 1
            messages = turn_messages(self.messages, [(x.answer, x.reasoning) for x in out],
                                     [x["user"] for x in self.later_turns[:k]])
            out.append(Turn(messages, t.get("reasoning") or None, t.get("answer"), t["finish_reason"],
                            t.get("token_ids"), int(t.get("prompt_tokens") or 0)))
        return out, 0


@dataclass
class Counts:
    input_rows: int = 0
    dropped_failed: int = 0
    dropped_overlength: int = 0
    truncated: int = 0
    dropped_empty: int = 0
    rows_with_reasoning: int = 0
    turns_in_loss: int = 0
    turns_failed: int = 0           # later turns that failed (their conversation ends before them)
    conversations_split: int = 0    # conversations written as more than one training row
    turns_spliced: int = 0
    turns_reencoded: int = 0
    reencode_differs: int = 0       # spliced turns whose text re-encodes to other tokens
    roundtrip_differs: int = 0      # re-encoded answers whose text does not survive encode/decode
    prompt_length_differs: int = 0  # turns whose rendered prompt length differs from the backend's count
    finish_reasons: Counter = field(default_factory=Counter)
    dropped_ids: dict[str, list[str]] = field(default_factory=lambda: {"failed": [], "overlength": [], "empty": []})
    reencode_differs_ids: list[str] = field(default_factory=list)


class ChatRenderer:
    """Renders trace rows with the target's chat template and builds their loss masks."""

    def __init__(self, tokenizer, end_of_turn_ids: set[int], template_kwargs: dict):
        self.tok = tokenizer
        self.end_of_turn_ids = end_of_turn_ids
        self.kwargs = template_kwargs
        self.reasoning_format = self._probe_reasoning_format()

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **self.kwargs)

    def _probe_reasoning_format(self) -> str | None:
        """'template' when the template renders `reasoning_content`, else 'inline'; None when
        it drops reasoning either way."""
        user = [{"role": "user", "content": "Hi"}]
        for fmt, message in [
            ("template", {"role": "assistant", "content": "Hello", "reasoning_content": PROBE_REASONING}),
            ("inline", {"role": "assistant", "content": inline_reasoning(PROBE_REASONING, "Hello")}),
        ]:
            if PROBE_REASONING in self.render(user + [message], add_generation_prompt=False):
                return fmt
        return None

    def assistant_message(self, row: TraceRow, turn: Turn) -> dict:
        answer = turn.answer or ""
        if not turn.reasoning:
            return {"role": "assistant", "content": answer}
        if self.reasoning_format == "template":
            return {"role": "assistant", "content": answer, "reasoning_content": turn.reasoning}
        if self.reasoning_format == "inline":
            return {"role": "assistant", "content": inline_reasoning(turn.reasoning, answer)}
        raise PipelineError(f"{row.where}: row {row.id} has reasoning, but the target's chat template drops it "
                            f"both as reasoning_content and inlined in <think> tags, so the training rows could "
                            f"not contain what the target generated. Give the target a template that renders "
                            f"reasoning, or generate without a reasoning parser")

    def encode(self, row: TraceRow, counts: Counts | None = None) -> list[tuple[list[int], list[int]]]:
        """[(input_ids, loss_mask)] of one conversation: usually one row; more where the
        template re-renders an earlier answer otherwise than the target produced it. The mask
        covers the target's own tokens only."""
        counts = counts or Counts()
        turns, counts_failed = row.turns()
        counts.turns_failed += counts_failed
        pieces: list[tuple[list[int], list[int]]] = []
        ids: list[int] | None = None
        mask: list[int] = []
        for turn in turns:
            prompt_text = self.render(turn.messages, add_generation_prompt=True)
            prompt_ids = self._ids(prompt_text)
            if turn.prompt_tokens and turn.prompt_tokens != len(prompt_ids):
                counts.prompt_length_differs += 1
            completion = self.completion_ids(row, turn, prompt_text, prompt_ids, counts)
            if ids is not None and len(prompt_ids) >= len(ids) and prompt_ids[:len(ids)] == ids:
                mask += [0] * (len(prompt_ids) - len(ids))  # this turn continues the row
                ids = list(prompt_ids)
            else:
                if ids is not None:
                    pieces.append((ids, mask))
                ids, mask = list(prompt_ids), [0] * len(prompt_ids)
            ids += completion
            mask += [1] * len(completion)
            counts.turns_in_loss += bool(completion)
        pieces.append((ids, mask))
        counts.conversations_split += len(pieces) > 1
        return pieces

    def completion_ids(self, row: TraceRow, turn: Turn, prompt_text: str, prompt_ids: list[int],
                       counts: Counts) -> list[int]:
        """The answer's tokens: the ids the target emitted when the trace has them, else its
        text re-encoded."""
        if turn.token_ids is not None:
            counts.turns_spliced += 1
            try:
                reencoded = self.reencode(row, turn, prompt_text, prompt_ids)
            except PipelineError:  # the render cannot even place the text: re-encoding would be wrong
                reencoded = None
            if reencoded != turn.token_ids:
                counts.reencode_differs += 1
                if row.id not in counts.reencode_differs_ids[-1:]:
                    counts.reencode_differs_ids.append(row.id)
            return list(turn.token_ids)
        counts.turns_reencoded += 1
        text = turn.answer or ""
        if text and self.tok.decode(self._ids(text)) != text:
            counts.roundtrip_differs += 1
        return self.reencode(row, turn, prompt_text, prompt_ids)

    def reencode(self, row: TraceRow, turn: Turn, prompt_text: str, prompt_ids: list[int]) -> list[int]:
        """The answer's tokens as the render with the answer encodes them (see the module doc)."""
        full_text = self.render(turn.messages + [self.assistant_message(row, turn)], add_generation_prompt=False)
        cut = self._generated_end(turn, full_text, len(prompt_text)) if turn.finish_reason == "length" else None
        full_ids = self._ids(full_text[:cut])
        if full_ids[:len(prompt_ids)] != prompt_ids:
            k = next((i for i, (a, b) in enumerate(zip(prompt_ids, full_ids)) if a != b), len(full_ids))
            raise PipelineError(
                f"{row.where}: row {row.id}: the chat template's prompt render (add_generation_prompt=True, "
                f"{len(prompt_ids)} tokens) is not a token prefix of its render with the answer (first "
                f"difference at token {k}: {self.tok.decode(prompt_ids[k:k + 8])!r} vs "
                f"{self.tok.decode(full_ids[k:k + 8])!r}), so the answer's tokens cannot be located. Fix the "
                f"template or pass the chat_template_kwargs generation used (tokenize.chat_template_kwargs)")
        completion = full_ids[len(prompt_ids):]
        if cut is not None:  # cut at max_tokens: the render ends where the target's text ended
            return completion
        end = next((i for i, t in enumerate(completion) if t in self.end_of_turn_ids), None)
        if end is None:
            raise PipelineError(
                f"{row.where}: row {row.id}: the chat template puts no end-of-turn token (ids "
                f"{sorted(self.end_of_turn_ids)}, from generation_config.json and the tokenizer's eos) after "
                f"the answer; add the model's stop token to generation_config.json eos_token_id")
        # A turn cut at max_tokens never generated the end-of-turn token.
        return completion[:end if turn.finish_reason == "length" else end + 1]

    @staticmethod
    def _generated_end(turn: Turn, full_text: str, prompt_chars: int) -> int | None:
        """Where the target's own text ends in the render of a turn cut at max_tokens. What the
        template adds after it (closing think tag, end of turn) was never generated. None when
        the text cannot be found as written (a template that rewrites it)."""
        tail = turn.answer or turn.reasoning or ""
        for candidate in (tail, tail.rstrip()):
            pos = full_text.rfind(candidate) if candidate else -1
            if pos >= prompt_chars:
                return pos + len(candidate)
        return None

    def _ids(self, text: str) -> list[int]:
        # The template already holds every special token (BOS included), as vLLM renders chats.
        return self.tok(text, add_special_tokens=False)["input_ids"]


def end_of_turn_ids(target: Path, tokenizer) -> set[int]:
    """The ids that end an assistant turn: what vLLM stops on (generation_config + tokenizer eos)."""
    ids: set[int] = set()
    gen_path = target / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise PipelineError(f"{target}: no eos token in generation_config.json or the tokenizer; the end of an "
                            f"assistant turn is unknown")
    return ids


def fit_length(ids: list[int], mask: list[int], settings: dict, counts: Counts, row_id: str):
    """Apply tokenize.max_seq_len / overlength; None when the row is dropped."""
    max_len = int(settings.get("max_seq_len", 4096))
    if len(ids) <= max_len:
        return ids, mask
    if settings.get("overlength", "truncate") == "truncate" and any(mask[:max_len]):
        counts.truncated += 1
        return ids[:max_len], mask[:max_len]
    # Dropped by setting, or the prompt alone fills max_seq_len (nothing left to learn).
    counts.dropped_overlength += 1
    counts.dropped_ids["overlength"].append(row_id)
    return None


def tokenize_traces(traces: Path, renderer: ChatRenderer, settings: dict, counts: Counts):
    """Yield (row id, input_ids, loss_mask) in trace order; a conversation written as several
    rows yields `id`, `id#2`, ..."""
    drop_failed = bool(settings.get("drop_failed", True))
    for lineno, raw in read_jsonl(traces):
        row = TraceRow.parse(raw, f"{traces}:{lineno}")
        counts.input_rows += 1
        counts.finish_reasons[row.finish_reason] += 1
        if row.finish_reason == "error":
            if not drop_failed:
                raise PipelineError(f"{row.where}: row {row.id}: generation failed ({row.error}); rerun the traces "
                                    f"stage or set tokenize.drop_failed: true")
            counts.dropped_failed += 1
            counts.dropped_ids["failed"].append(row.id)
            continue
        counts.rows_with_reasoning += bool(row.reasoning)
        pieces = [(ids, mask) for ids, mask in renderer.encode(row, counts) if any(mask)]
        if not pieces:  # cut at max_tokens before any visible text: nothing to learn
            counts.dropped_empty += 1
            counts.dropped_ids["empty"].append(row.id)
            continue
        for j, (ids, mask) in enumerate(pieces):
            row_id = row.id if j == 0 else f"{row.id}#{j + 1}"
            fitted = fit_length(ids, mask, settings, counts, row_id)
            if fitted is not None:
                yield row_id, *fitted


def write_dataset(out_dir: Path, input_ids: list[list[int]], loss_masks: list[list[int]]) -> None:
    """speculators' --data-path format: save_to_disk, int64 columns, torch format."""
    import datasets
    from datasets import Dataset, Features, List, Value

    datasets.disable_progress_bars()
    features = Features({"input_ids": List(Value("int64")), "loss_mask": List(Value("int64")),
                         "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_masks,
                            "seq_len": [len(x) for x in input_ids]}, features=features)
    ds.set_format("torch")
    with atomic_dir(out_dir) as tmp:
        ds.save_to_disk(str(tmp))


def write_token_freq(path: Path, input_ids: list[list[int]], loss_masks: list[list[int]]) -> Counter:
    import torch

    freq: Counter = Counter()
    for ids, mask in zip(input_ids, loss_masks):
        freq.update(t for t, m in zip(ids, mask) if m)
    buf = io.BytesIO()
    torch.save(dict(freq), buf)
    atomic_write_bytes(path, buf.getvalue())
    return freq


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, help="materialized target dir (tokenizer + chat template)")
    p.add_argument("--manifest", required=True, help="target manifest.json")
    p.add_argument("--traces", required=True, help="traces.jsonl")
    p.add_argument("--out-data", required=True, help="datasets dir to write (speculators --data-path files)")
    p.add_argument("--token-freq", required=True, help="token_freq.pt to write")
    p.add_argument("--stats", required=True, help="stats.json to write")
    p.add_argument("--provenance", required=True, help="provenance.json to write")
    args = p.parse_args()
    runtime.setup()
    settings = args.settings
    prov = Provenance("tokenize", settings)
    target, traces = Path(args.target), Path(args.traces)
    if not traces.exists():
        raise PipelineError(f"{traces}: traces file not found; run the traces stage first")
    manifest = load_manifest(args.manifest)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=bool(settings.get("trust_remote_code")))
    template = tokenizer.chat_template
    if not template:
        raise PipelineError(f"{target}: the target's tokenizer has no chat template; rerun the target stage")
    # Digests of what was actually loaded here; stats.json records them for the contract checks.
    template_digest = chat_template_digest(template)
    tok_digest = tokenizer_digest(target)
    for what, loaded, key in (("chat template differs from the one", template_digest, "chat_template_digest"),
                              ("tokenizer files differ from the ones", tok_digest, "tokenizer_digest")):
        if loaded != manifest.get(key):
            raise PipelineError(f"{target}: its {what} in {args.manifest} (the model dir changed after the "
                                f"target stage); rerun the target stage")

    renderer = ChatRenderer(tokenizer, end_of_turn_ids(target, tokenizer), settings.get("chat_template_kwargs") or {})
    counts = Counts()
    row_ids, input_ids, loss_masks = [], [], []
    for row_id, ids, mask in tokenize_traces(traces, renderer, settings, counts):
        row_ids.append(row_id)
        input_ids.append(ids)
        loss_masks.append(mask)
    if not row_ids:
        raise PipelineError(f"{traces}: no usable row ({counts.input_rows} rows, {counts.dropped_failed} failed, "
                            f"{counts.dropped_overlength} over tokenize.max_seq_len, {counts.dropped_empty} "
                            f"empty); check the traces stage's log "
                            f"or raise tokenize.max_seq_len")

    write_dataset(Path(args.out_data), input_ids, loss_masks)
    freq = write_token_freq(Path(args.token_freq), input_ids, loss_masks)
    stats = {
        "rows": len(row_ids),
        "input_rows": counts.input_rows,
        "dropped_failed": counts.dropped_failed,
        "dropped_overlength": counts.dropped_overlength,
        "truncated": counts.truncated,
        "dropped_empty": counts.dropped_empty,
        "tokens": sum(len(x) for x in input_ids),
        "loss_tokens": sum(freq.values()),
        "max_seq_len": int(settings.get("max_seq_len", 4096)),
        "longest_row": max(len(x) for x in input_ids),
        "row_ids": row_ids,
        "dropped_ids": counts.dropped_ids,
        "finish_reasons": dict(counts.finish_reasons),
        "rows_with_reasoning": counts.rows_with_reasoning,
        "turns_in_loss": counts.turns_in_loss,
        "turns_failed": counts.turns_failed,
        "conversations_split": counts.conversations_split,
        "turns_spliced": counts.turns_spliced,
        "turns_reencoded": counts.turns_reencoded,
        "reencode_differs": counts.reencode_differs,
        "reencode_differs_ids": counts.reencode_differs_ids[:100],
        "roundtrip_differs": counts.roundtrip_differs,
        "prompt_length_differs": counts.prompt_length_differs,
        "reasoning_format": renderer.reasoning_format,
        "tokenizer_digest": tok_digest,
        "chat_template_digest": template_digest,
        "end_of_turn_ids": sorted(renderer.end_of_turn_ids),
    }
    atomic_write_json(args.stats, stats)
    prov.write(args.provenance, inputs={"target": target, "manifest": args.manifest, "traces": traces},
               outputs={"data": args.out_data, "token_freq": args.token_freq, "stats": args.stats})
    print(f"tokenized {stats['rows']} rows from {counts.input_rows} conversations ({counts.dropped_failed} failed, "
          f"{counts.dropped_overlength} over length dropped, {counts.truncated} truncated): {stats['tokens']} tokens, "
          f"{stats['loss_tokens']} in the loss from {counts.turns_in_loss} answered turns "
          f"({counts.turns_spliced} spliced as the target emitted them, {counts.reencode_differs} of those re-encode "
          f"differently; {counts.turns_reencoded} re-encoded from text); reasoning {renderer.reasoning_format}",
          flush=True)


if __name__ == "__main__":
    run_main(main)
