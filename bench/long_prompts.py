#!/usr/bin/env python
"""Long prompts for the hidden-state and training benchmark: real chat text (the chitchat
corpus on PyPI), whole conversations concatenated into one user turn of a seeded length between
--min-tokens and --max-tokens (counted with the target's tokenizer and chat template), followed
by a request for a short answer. Writes a `messages`-format JSONL for the prompts stage.

    python bench/long_prompts.py --target T --out long_prompts.jsonl --rows 400 --min-tokens 1000 --max-tokens 3900"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from pipeline_lib.assets import resolve_asset  # noqa: E402
from pipeline_lib.io import atomic_write_jsonl  # noqa: E402

ASK = "\n\nSummarize the conversation above in one sentence."


def conversations() -> list[str]:
    data = json.loads(Path(resolve_asset("pypi:chitchat_dataset/dataset.json")).read_text())
    texts = []
    for conv in data.values():
        lines = [f"{'AB'[i % 2]}: {msg['text']}" for i, turn in enumerate(conv["messages"]) for msg in turn]
        texts.append("\n".join(lines))
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="model dir (its tokenizer counts the tokens)")
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--min-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=3900)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    rng = random.Random(args.seed)
    pool = conversations()
    rng.shuffle(pool)
    sizes = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in pool]
    rows, at, total = [], 0, 0
    for i in range(args.rows):
        want = rng.randint(args.min_tokens, args.max_tokens)
        parts, n = [], 0
        while n < want:
            parts.append(pool[at % len(pool)])
            n += sizes[at % len(pool)] + 2
            at += 1
        text = "\n\n".join(parts)
        ids = tok(text, add_special_tokens=False)["input_ids"][:want]  # cut to the drawn length
        content = tok.decode(ids) + ASK
        rows.append({"id": f"long-{i}", "messages": [{"role": "user", "content": content}]})
        total += len(ids)
    atomic_write_jsonl(args.out, rows)
    print(f"wrote {len(rows)} prompts, ~{total} prompt tokens ({total // max(1, len(rows))} a row) to {args.out}")


if __name__ == "__main__":
    main()
