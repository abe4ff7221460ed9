"""Traces speed: the transformers backend (the pipeline's trace rows: rendering, sorted batches,
answer splitting) next to transformers' `generate` alone on the same prompts, the same sorted
batches and the same max_tokens, in one run: what the backend costs on top of the decoding it
uses. With --vllm, the pipeline's vLLM backend (its default) answers the same prompts last, in
the same run, after the transformers model is freed. Prints the table and writes it as JSON.
bench/decode_designs.py compares decoding designs.

Usage: python bench/traces_speed.py --target DIR --prompts prompts.jsonl [--num 2048]
       [--batch-size 256] [--max-tokens 128] [--dtype bfloat16] [--vllm] --out table.json
The prompts file is the pipeline's prompts/train.jsonl (each row's first user turn is asked).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
WARMUP_PROMPTS = 16


def first_turns(path: Path, num: int) -> list[list[dict]]:
    rows = []
    with open(path) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            rows.append(messages[:user + 1])
            if len(rows) == num:
                break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--num", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vllm", action="store_true", help="also time the vLLM backend on the same prompts")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    import torch

    from pipeline_lib.generation import GenerationSettings, PromptRequest, make_backend
    from pipeline_lib.io import atomic_write_json

    settings = GenerationSettings.from_dict({"backend": "transformers", "max_tokens": args.max_tokens,
                                             "batch_size": args.batch_size})
    backend = make_backend(settings, args.target, args.dtype, log=print)
    backend.start()
    requests = [PromptRequest(f"p{i}", m) for i, m in enumerate(first_turns(args.prompts, args.num))]
    sync = torch.cuda.synchronize if backend.device == "cuda" else (lambda: None)

    # Both paths warm up (untimed) on the same few prompts first: CUDA, cuBLAS and the attention
    # kernels initialise on first use, which a traces job pays once, not per batch.
    warm = requests[:WARMUP_PROMPTS]
    t0 = time.monotonic()
    list(backend.generate(warm))
    sync()
    warmup_s = {"backend": round(time.monotonic() - t0, 2)}
    warmup_batches = backend.describe()["batches"]
    ids, mask, _ = backend._inputs([backend._render(r) for r in warm])
    t0 = time.monotonic()
    with torch.inference_mode():
        backend.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens, do_sample=False,
                               temperature=None, top_p=None, top_k=None, pad_token_id=backend.pad_id)
    sync()
    warmup_s["generate_alone"] = round(time.monotonic() - t0, 2)

    t0 = time.monotonic()
    completions = list(backend.generate(requests))
    sync()
    backend_s = time.monotonic() - t0
    stats = backend.describe()
    batches = stats["batches"] - warmup_batches
    backend_tokens = sum(c.completion_tokens or 0 for c in completions)

    # generate alone: the same sorted batches, left padded, its default (dynamic) cache.
    prompts = []
    for r in requests:  # the prompts the backend answered (over-long ones it rejects are skipped)
        try:
            prompts.append(backend._render(r))
        except ValueError:
            continue
    prompts.sort(key=len, reverse=True)
    eos = sorted(backend.eos_ids)
    plain_tokens, plain_s = 0, 0.0
    for start in range(0, len(prompts), args.batch_size):
        input_ids, mask, width = backend._inputs(prompts[start:start + args.batch_size])
        t0 = time.monotonic()
        with torch.inference_mode():
            out = backend.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                                         do_sample=False, temperature=None, top_p=None, top_k=None,
                                         eos_token_id=eos, pad_token_id=backend.pad_id)
        sync()
        plain_s += time.monotonic() - t0
        for row in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in backend.eos_ids), None)
            plain_tokens += len(row) if stop is None else stop + 1

    table = {
        "prompts": len(requests), "batch_size": args.batch_size, "max_tokens": args.max_tokens,
        "warmup_s": warmup_s, "warmup_prompts": len(warm),
        "device": torch.cuda.get_device_name() if backend.device == "cuda" else "cpu",
        "backend": {"tokens": backend_tokens, "seconds": round(backend_s, 2), "tok_s": round(backend_tokens / backend_s),
                    "batches": batches, "decoding": stats["decoding"]},
        "generate_alone": {"tokens": plain_tokens, "seconds": round(plain_s, 2),
                           "tok_s": round(plain_tokens / plain_s)},
    }
    table["ratio"] = round(table["backend"]["tok_s"] / table["generate_alone"]["tok_s"], 2)
    if args.vllm:
        del backend
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        table["vllm"] = time_vllm(args, requests, warm)
        table["ratio_vllm_to_backend"] = round(table["vllm"]["tok_s"] / table["backend"]["tok_s"], 2)
    atomic_write_json(args.out, table)
    print(f"| path | tokens | seconds | tok/s |\n|---|---|---|---|\n"
          f"| backend ({stats['decoding']}) | {backend_tokens:,} | {backend_s:.1f} | {table['backend']['tok_s']:,} |\n"
          f"| `generate` alone | {plain_tokens:,} | {plain_s:.1f} | {table['generate_alone']['tok_s']:,} |\n"
          f"ratio backend / generate alone: {table['ratio']}; {batches} batches of {args.batch_size} "
          f"after an untimed warm-up on {len(warm)} prompts ({warmup_s['backend']} s / {warmup_s['generate_alone']} s)")
    if args.vllm:
        v = table["vllm"]
        print(f"vLLM backend: {v['tokens']:,} tokens in {v['seconds']} s = {v['tok_s']:,} tok/s "
              f"({table['ratio_vllm_to_backend']}x the transformers backend; engine start {v['engine_start_s']} s, untimed)")


def time_vllm(args, requests, warm) -> dict:
    """The pipeline's vLLM traces backend (what `generation.backend: vllm` runs) on the same
    requests: engine start and a warm-up untimed, then all requests in one timed pass."""
    from pipeline_lib.generation import GenerationSettings, make_backend

    settings = GenerationSettings.from_dict({"backend": "vllm", "max_tokens": args.max_tokens,
                                             "batch_size": args.batch_size})
    backend = make_backend(settings, args.target, args.dtype, log=print)
    t0 = time.monotonic()
    backend.start()
    list(backend.generate(warm))
    start_s = time.monotonic() - t0
    t0 = time.monotonic()
    completions = list(backend.generate(requests))
    seconds = time.monotonic() - t0
    tokens = sum(c.completion_tokens or 0 for c in completions)
    if hasattr(backend, "close"):
        backend.close()
    return {"tokens": tokens, "prompt_tokens": sum(c.prompt_tokens or 0 for c in completions),
            "seconds": round(seconds, 2), "tok_s": round(tokens / seconds),
            "engine_start_s": round(start_s, 1), "answered": sum(1 for c in completions if c.completion_tokens)}



if __name__ == "__main__":
    main()
