"""Inputs every acceptance backend reads: the eval prompts rendered with the target's chat
template, and the MeasureSpec each measurement job builds once."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import PipelineError
from ..io import read_jsonl

# The token that closes the reasoning section, per vLLM reasoning parser name. Anything not
# listed uses DEFAULT_REASONING_END (the <think>...</think> convention of most parsers).
REASONING_END_MARKERS = {"mistral": "[/THINK]"}
DEFAULT_REASONING_END = "</think>"


@dataclass
class EvalPrompt:
    id: str
    category: str | None
    token_ids: list[int]


@dataclass
class MeasureSpec:
    """Everything a backend needs; built once per job (job.measure_spec)."""

    target: str
    prompts: list[EvalPrompt]
    num_speculative_tokens: int
    max_tokens: int
    dtype: str
    concurrency_one_prompts: int
    eos_token_ids: list[int]
    draft: str = ""       # the drafts' dirs: empty in the baseline job (the target alone)
    untrained: str = ""
    untrained_prompts: int | None = None  # None = all; else that many, round-robin over categories
    reasoning_end_token_id: int | None = None
    context_limit: int | None = None     # the target's max_position_embeddings
    trust_remote_code: bool = False
    seed: int = 0
    batch_size: int = 64                 # transformers backend: sequences per batched pass
    speedup_rounds: int = 3              # interleaved rounds without / with the draft (speedup.py)
    speedup_batch_prompts: int | None = None  # prompts decoded at once in each round; None = all
    speedup_engines: str = "auto"        # together, in_turn or auto (speedup.engines_in_turn)
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def concurrency_one(self) -> list[EvalPrompt]:
        return self.prompts[: self.concurrency_one_prompts]

    @property
    def speedup_batch(self) -> list[EvalPrompt]:
        return self.prompts[: self.speedup_batch_prompts] if self.speedup_batch_prompts else list(self.prompts)

    @property
    def untrained_subset(self) -> list[EvalPrompt]:
        """The prompts the untrained baseline runs on: all, or `untrained_prompts` of them taken
        round-robin over the categories (the first of each category, then the second, ...), so
        every category has a baseline; in eval-set order. The baseline only shows that a draft
        with random weights gets ~1.0, and its engine run costs as much as the trained draft's
        (minutes on a 2-core CPU machine)."""
        if self.untrained_prompts is None or self.untrained_prompts >= len(self.prompts):
            return list(self.prompts)
        by_category: dict[str | None, list[int]] = {}
        for i, p in enumerate(self.prompts):
            by_category.setdefault(p.category, []).append(i)
        picked: list[int] = []
        for rank in range(max(len(v) for v in by_category.values())):
            picked += [idx[rank] for idx in by_category.values() if rank < len(idx)]
        return [self.prompts[i] for i in sorted(picked[: self.untrained_prompts])]


def load_eval_prompts(path: str | Path, num_prompts: int | None, tokenizer,
                      chat_template_kwargs: dict | None = None,
                      max_prompt_tokens: int | None = None) -> tuple[list[EvalPrompt], list[dict]]:
    """(prompts, skipped): the first `num_prompts` rows of prompts/eval.jsonl, rendered with
    the target's chat template (generation prompt added) so both backends see identical token
    ids. Rows longer than `max_prompt_tokens` (the target's context minus the answer budget)
    cannot be measured; they are skipped and listed, not allowed to fail the engine."""
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"{path}: eval prompts file not found; run the prompts_eval rule "
                            f"(snakemake ... prompts_eval) or fix prompts.eval.source")
    prompts, skipped, rows_read = [], [], 0
    for lineno, row in read_jsonl(path):
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
            raise PipelineError(f"{path}:{lineno}: 'messages' must be a non-empty list ending with a "
                                f"user turn (see docs/artifacts.md, prompts/eval.jsonl)")
        if "id" not in row:
            raise PipelineError(f"{path}:{lineno}: row has no 'id'")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **(chat_template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        rows_read += 1
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            skipped.append({"id": str(row["id"]), "line": lineno, "prompt_tokens": len(ids),
                            "max_prompt_tokens": max_prompt_tokens})
        else:
            prompts.append(EvalPrompt(id=str(row["id"]), category=row.get("category"), token_ids=list(map(int, ids))))
        if num_prompts is not None and rows_read >= num_prompts:
            break
    if not prompts:
        why = f" ({len(skipped)} longer than {max_prompt_tokens} tokens)" if skipped else ""
        raise PipelineError(f"{path}: no prompts the target can answer{why}; the eval set is empty")
    return prompts, skipped


def reasoning_end_token_id(tokenizer, parser: str | None) -> tuple[int | None, str | None]:
    """(token id, marker) that ends the reasoning span, or (None, reason) when not applicable."""
    if not parser:
        return None, None
    marker = REASONING_END_MARKERS.get(parser, DEFAULT_REASONING_END)
    tid = tokenizer.convert_tokens_to_ids(marker)
    if tid is None or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(tid) != marker:
        return None, f"reasoning parser {parser}: marker {marker!r} is not a single token of the target's tokenizer"
    return int(tid), marker




def answer_room(max_tokens: int, num_speculative_tokens: int) -> int:
    """Context a prompt must leave free: its answer, the draft's lookahead and a small margin."""
    return max_tokens + num_speculative_tokens + 16
