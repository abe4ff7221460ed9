#!/usr/bin/env python
"""Where batched greedy decoding spends its time on a GPU, design by design, in one run: the
evidence behind the traces backend's and the acceptance job's decoding choices.

A random-weight model of the target's shape (--config: a config.json, e.g. the demo target's)
answers the same prompts (random token ids of the lengths in --lengths, or 60-300) in batches of
--batch-size, --max-tokens new tokens each (random weights never emit EOS: every row runs to the
end, so tokens/s is steps x batch). Designs, each timed after its own warm-up unless "first":
  dynamic         HF generate, its default dynamic cache, eager: first pass over the batches
                  (fresh shapes), then the same again (what a second pass over equal shapes costs)
  dynamic-nocudnn the same with cuDNN attention off (other shapes, so nothing is cached)
  static-eager    static cache, no compile
  static-compiled static cache, transformers compiles the decoding step (the traces backend)
  loop-graphs     a plain greedy loop: StaticCache, torch.compile(mode="reduce-overhead") of the
                  forward (cache length doubled to a power of two, HF's masks, K/V repeated)
  graph-decode    the traces backend's greedy loop (scripts/pipeline_lib/generation/graph_decode):
                  static cache sized to the batch, one CUDA graph per batch, grouped-query
                  attention without repeated K/V
  cb, cb-graphs   transformers' own continuous batching (model.generate_batch: paged cache, all
                  prompts submitted at once), with its default settings / CUDA graphs forced on
and a torch.profiler table of a few static-compiled decode steps (self CPU vs CUDA time).

    python bench/decode_designs.py --config config.json --out designs.json   # GPU
    BENCH_SMOKE=1 python bench/decode_designs.py --out /tmp/d.json             # CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=512, max_position_embeddings=2048, model_type="llama")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, help="config.json of the target's shape (default: tiny, smoke)")
    ap.add_argument("--lengths", type=Path, help="JSON list of prompt lengths (tokens)")
    ap.add_argument("--batches", type=int, default=2 if SMOKE else 4)
    ap.add_argument("--batch-size", type=int, default=8 if SMOKE else 256)
    ap.add_argument("--max-tokens", type=int, default=8 if SMOKE else 128)
    ap.add_argument("--designs", default="dynamic-nocudnn,graph-decode,cb,cb-graphs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = AutoConfig.from_pretrained(args.config.parent) if args.config else AutoConfig.for_model(**TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(dev).eval()
    model.generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    lengths = json.loads(args.lengths.read_text()) if args.lengths else [random.Random(0).randint(60, 300)
                                                                         for _ in range(4096)]
    rng = random.Random(1)
    need = args.batches * args.batch_size

    def make_batches(shift: int):
        """Sorted batches of random prompts; `shift` tokens longer, so their shapes are new."""
        lens = sorted((rng.choice(lengths) + shift for _ in range(need)), reverse=True)
        out = []
        for i in range(0, need, args.batch_size):
            chunk = lens[i:i + args.batch_size]
            width = chunk[0]
            ids = torch.randint(10, cfg.vocab_size, (len(chunk), width), device=dev)
            mask = torch.tensor([[0] * (width - n) + [1] * n for n in chunk], device=dev)
            out.append((ids, mask))
        return out

    def cache_len(width: int) -> int:
        n = 256
        while n < width + args.max_tokens:
            n *= 2
        return n

    def timed(fn, batches) -> dict:
        sync()
        t0 = time.perf_counter()
        tokens = 0
        for ids, mask in batches:
            tokens += fn(ids, mask)
        sync()
        s = time.perf_counter() - t0
        steps = args.batches * args.max_tokens
        return {"seconds": round(s, 3), "tokens": tokens, "tok_s": round(tokens / s), "ms_per_step": round(1000 * s / steps, 2)}

    def generate(ids, mask, **kw):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                 do_sample=False, pad_token_id=0, **kw)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    def static(compiled: bool):
        return lambda ids, mask: generate(ids, mask, cache_implementation="static", max_cache_len=cache_len(ids.shape[1]),
                                          disable_compile=not compiled)

    compiled_forward = {}

    def loop_graphs(ids, mask):
        """Greedy decoding by hand: one static cache, the one-token forward compiled with CUDA graphs."""
        b, width = ids.shape
        n = cache_len(width)
        cache = StaticCache(config=cfg, max_cache_len=n)
        fwd = compiled_forward.setdefault("f", torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                                          if dev.type == "cuda" else model.forward)
        full = torch.zeros(b, n, dtype=mask.dtype, device=dev)
        full[:, :width] = mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=full[:, :width], position_ids=pos, past_key_values=cache,
                        cache_position=torch.arange(width, device=dev), logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            last = pos[:, -1:]
            for step in range(args.max_tokens - 1):
                at = width + step
                full[:, at] = 1
                last = last + 1
                out = fwd(input_ids=tok, attention_mask=full, position_ids=last, past_key_values=cache,
                          cache_position=torch.tensor([at], device=dev))
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return b * args.max_tokens

    from pipeline_lib.generation import graph_decode

    def graph_loop(ids, mask):
        graph_decode.prepare(model)
        try:
            rows = graph_decode.greedy_batch(model, ids, mask, args.max_tokens, {-1}, 0)
        finally:
            model.set_attn_implementation("sdpa")
        return sum(len(r) for r in rows)

    def continuous(graphs: bool):
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        def run_all(batches) -> int:
            prompts = [row[m.bool()].tolist() for ids, mask in batches for row, m in zip(ids, mask)]
            gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
            cb = ContinuousBatchingConfig(use_cuda_graph=graphs or None)
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
            failed = [o.error for o in out.values() if o.error]
            if failed or len(out) != len(prompts):
                print(f"continuous batching: {len(out)} of {len(prompts)} answered; errors: {failed[:3]}")
            return sum(len(o.generated_tokens) for o in out.values())
        return run_all

    designs = args.designs.split(",")
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": str(dtype),
              "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "batch_size": args.batch_size,
              "batches": args.batches, "max_tokens": args.max_tokens, "torch": torch.__version__, "designs": {}}
    shift = 0
    for name in designs:
        shift += 1
        batches = make_batches(shift)
        t_start = time.perf_counter()
        if name == "dynamic":
            result["designs"]["dynamic (first pass)"] = timed(generate, batches)
            result["designs"]["dynamic (same shapes again)"] = timed(generate, batches)
        elif name == "dynamic-nocudnn":
            torch.backends.cuda.enable_cudnn_sdp(False)
            result["designs"]["dynamic, cuDNN attention off (first pass)"] = timed(generate, batches)
            torch.backends.cuda.enable_cudnn_sdp(True)
        elif name in ("cb", "cb-graphs"):
            run_all = continuous(name == "cb-graphs")
            sync()
            t0 = time.perf_counter()
            tokens = run_all(batches)
            sync()
            s = time.perf_counter() - t0
            result["designs"][name] = {"seconds": round(s, 3), "tokens": tokens, "tok_s": round(tokens / s),
                                       "ms_per_step": round(1000 * s / (args.batches * args.max_tokens), 2),
                                       "note": "all prompts at once, warm-up included"}
        elif name in ("static-eager", "static-compiled", "loop-graphs", "graph-decode"):
            fn = {"static-eager": static(False), "static-compiled": static(True), "loop-graphs": loop_graphs,
                  "graph-decode": graph_loop}[name]
            t0 = time.perf_counter()
            timed(fn, batches[:1])  # warm-up / compile on the first batch's shapes
            warm = time.perf_counter() - t0
            result["designs"][name] = {**timed(fn, batches), "warmup_s": round(warm, 1)}
        print(f"{name}: {time.perf_counter() - t_start:.1f} s", flush=True)
        print(json.dumps(result["designs"], indent=1), flush=True)

    if "static-compiled" in designs and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        ids, mask = make_batches(1)[0]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            static(True)(ids, mask)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        result["profile_top_cpu"] = table
        print(table)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    from torch._dynamo.utils import counters
    result["dynamo_counters"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "recompiles")}
    print("dynamo:", result["dynamo_counters"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"| design | ms/step | tok/s |\n|---|---|---|")
    for name, r in result["designs"].items():
        print(f"| {name} | {r['ms_per_step']} | {r['tok_s']:,} |")


if __name__ == "__main__":
    sys.exit(main())
