#!/usr/bin/env python
"""Test helper: real target generations, written as traces.jsonl rows (docs/artifacts.md).

Runs offline vLLM `LLM.chat` on a target dir for the prompt rows in --prompts and writes one
trace row per prompt with `token_ids` (what vLLM sampled, as the traces stage keeps them), plus
`prompt_token_ids`, so tests can compare the tokenize stage's rows with the tokens the target
really saw and produced. A random-weight
target almost never samples its end-of-turn token, so --eos-bias raises its logit to get a
mix of rows that stop and rows cut at max_tokens (every other prompt also gets only 3 tokens);
special tokens other than the end of turn are banned so that the answer text holds every
generated token.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--eos-bias", type=float, default=5.0)
    args = p.parse_args()
    # The environment every pipeline job that loads a model sets up, and its choice of where
    # vLLM's engine runs (in this process on CPU, as scripts/load_check.py runs it).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from pipeline_lib import runtime

    runtime.setup()
    runtime.vllm_engine_in_process(on_gpu_too=True)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
    tok = AutoTokenizer.from_pretrained(args.target)
    eos = tok.eos_token_id
    bias = {i: -100.0 for i in tok.all_special_ids if i != eos}
    bias[eos] = args.eos_bias
    llm = LLM(model=args.target, enforce_eager=True, max_model_len=512, dtype="float32", seed=0)
    # Every other prompt gets a 3-token budget, so rows cut at max_tokens occur for sure.
    budgets = [args.max_tokens if i % 2 == 0 else 3 for i in range(len(rows))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=budgets[i], logit_bias=bias)
              for i in range(len(rows))]
    outputs = llm.chat([r["messages"] for r in rows], params, use_tqdm=False)
    with open(args.out, "w") as f:
        for i, (row, out) in enumerate(zip(rows, outputs)):
            gen = out.outputs[0]
            f.write(json.dumps({
                "id": row["id"], "messages": row["messages"], "reasoning": None, "answer": gen.text,
                "finish_reason": gen.finish_reason, "error": None,
                "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(gen.token_ids),
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": params[i].max_tokens, "seed": i},
                "backend": "vllm", "category": None,
                "token_ids": list(gen.token_ids), "later_turns": [], "turns_total": 1, "turns_dropped": 0,
                "prompt_token_ids": list(out.prompt_token_ids),
            }) + "\n")


if __name__ == "__main__":
    main()
