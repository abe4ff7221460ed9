"""Backend `transformers`: the same models in plain transformers, for targets vLLM cannot run
(or machines without vLLM), and as a cross-check of vLLM.

The numbers come from the batched exact path (batched.py): batched greedy generation, one
teacher-forced target pass and k batched draft passes per batch of prompts. The sequential
chain speculator (chain.py) runs on the concurrency-1 prompts: it times speculation one
prompt at a time against plain greedy decoding, and its step records must equal the batched
ones prompt by prompt (acceptance.json `self_check`), so every run proves its own exactness.
Nothing here imports vLLM."""
from __future__ import annotations

import time

from .batched import (draft_proposals, greedy_continuations, plain_record, right_padded, same_steps,
                      target_aux_hidden, walk_steps)
from .chain import ChainSpeculator, greedy_plain
from .draft import EagleDraft, load_draft_for_transformers
from .inputs import EvalPrompt, MeasureSpec
from .records import BackendFailure, RequestRecord, RunResult, register, request_steps
from .speedup import run_rounds


def _named(rec: RequestRecord, prompt: EvalPrompt) -> RequestRecord:
    rec.id, rec.category = prompt.id, prompt.category
    return rec


def _batches(prompts: list[EvalPrompt], size: int) -> list[list[EvalPrompt]]:
    """Batches of similar lengths (little padding), longest first."""
    ordered = sorted(prompts, key=lambda p: len(p.token_ids), reverse=True)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_batched(target, drafts: dict[str, EagleDraft], subsets: dict[str, list[EvalPrompt]],
                    prompts: list[EvalPrompt], k: int, max_tokens: int, eos: set[int], batch_size: int,
                    device, pad_id: int) -> tuple[dict[str, list[RequestRecord]], dict[str, float]]:
    """Records of every run (drafts' names + "no_draft") on their prompts, in eval order, and
    seconds per part: "generate" (the greedy continuations), "target" (teacher-forced
    passes), and one per draft (its proposals and the step walk)."""
    new_tokens = max_tokens + k - 1  # the last step at max_tokens - 1 compares k tokens ahead
    seconds = {"generate": 0.0, "target": 0.0, **{name: 0.0 for name in drafts}}
    wanted = {name: {p.id for p in subset} for name, subset in subsets.items()}
    by_id: dict[str, dict[str, RequestRecord]] = {name: {} for name in (*drafts, "no_draft")}
    any_draft = next(iter(drafts.values()))
    for batch in _batches(prompts, batch_size):
        t0 = time.perf_counter()
        conts = greedy_continuations(target, [p.token_ids for p in batch], new_tokens, eos, k, pad_id, device)
        _sync(device)
        seconds["generate"] += time.perf_counter() - t0
        for p, cont in zip(batch, conts):
            by_id["no_draft"][p.id] = _named(plain_record(cont, max_tokens, eos), p)
        seqs = [p.token_ids + c for p, c in zip(batch, conts)]
        t0 = time.perf_counter()
        input_ids = right_padded(seqs, device)
        aux = target_aux_hidden(target, any_draft, input_ids)  # all drafts read the same aux layers
        _sync(device)
        seconds["target"] += time.perf_counter() - t0
        for name, draft in drafts.items():
            rows = [i for i, p in enumerate(batch) if p.id in wanted[name]]
            if not rows:
                continue
            t0 = time.perf_counter()
            proposals = draft_proposals(draft, input_ids[rows], aux[rows], k).tolist()
            for row, props in zip(rows, proposals):
                p = batch[row]
                by_id[name][p.id] = _named(walk_steps(len(p.token_ids), seqs[row], props, k, max_tokens, eos), p)
            seconds[name] += time.perf_counter() - t0
    order = {name: subsets.get(name, prompts) for name in by_id}
    return {name: [by_id[name][p.id] for p in order[name]] for name in by_id}, seconds


def self_check(batched: list[RequestRecord], chain: list[RequestRecord]) -> dict:
    """Batched records vs the sequential chain's on the same prompts: identical, prompt by prompt?"""
    by_id = {r.id: r for r in batched}
    differing = [c.id for c in chain if not same_steps(by_id[c.id], c)]
    return {"compared": len(chain), "identical": len(chain) - len(differing), "differing_ids": differing,
            "passed": not differing,
            "what": "batched step records (output tokens, the draft's proposals and accepted count at every "
                    "verify step) vs sequential "
                    "chain speculation on the concurrency-1 prompts"}


def _load_target(spec: MeasureSpec):
    import torch
    from transformers import AutoModelForCausalLM

    from ..runtime import padded_batch_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    padded_batch_attention()
    target = AutoModelForCausalLM.from_pretrained(spec.target, dtype=getattr(torch, spec.dtype),
                                                  trust_remote_code=spec.trust_remote_code).to(device).eval()
    return target, device


def _one_at_a_time(fn, prompts: list[EvalPrompt]) -> tuple[list[RequestRecord], float]:
    t0 = time.perf_counter()
    records = [_named(fn(p.token_ids), p) for p in prompts]
    return records, time.perf_counter() - t0


@register("transformers", "no_draft")
def measure_transformers_no_draft(spec: MeasureSpec, engine_script: str | None = None) -> tuple[RunResult, list[str]]:
    """The target alone: batched greedy generation (the outputs speculation must reproduce)."""
    import torch

    target, device = _load_target(spec)
    eos = set(spec.eos_token_ids)
    pad_id = min(eos) if eos else 0
    by_id, generate_s = {}, 0.0
    with torch.inference_mode():
        greedy_plain(target, spec.prompts[0].token_ids, 4, eos, device)  # warm-up: lazy kernels, allocator
        spec.log(f"[acceptance] no_draft: batched greedy generation, {len(spec.prompts)} prompts")
        # The batches the drafts' job forms (same prompts, same batch size): the same greedy outputs.
        for batch in _batches(spec.prompts, spec.batch_size):
            t0 = time.perf_counter()
            conts = greedy_continuations(target, [p.token_ids for p in batch], spec.max_tokens, eos, 1, pad_id, device)
            _sync(device)
            generate_s += time.perf_counter() - t0
            by_id.update((p.id, _named(plain_record(c, spec.max_tokens, eos), p)) for p, c in zip(batch, conts))
    run = RunResult(records=[by_id[p.id] for p in spec.prompts], wall_s=generate_s,
                    parts_s={"generate": round(generate_s, 4)})
    return run, []


@register("transformers", "drafts")
def measure_transformers(spec: MeasureSpec, engine_script: str | None = None) -> tuple[dict[str, RunResult], list[str]]:
    import torch

    target, device = _load_target(spec)
    dtype = getattr(torch, spec.dtype)
    eos = set(spec.eos_token_ids)
    k = spec.num_speculative_tokens
    drafts = {}
    for run, path in (("trained", spec.draft), ("untrained", spec.untrained)):
        spec.log(f"[acceptance] {run}: loading draft {path}")
        try:
            drafts[run] = EagleDraft(load_draft_for_transformers(path, spec.target, dtype, device), device)
        except Exception as err:  # the draft does not load: recorded like vLLM's refusal
            raise BackendFailure(run, f"{type(err).__name__}: {err}") from None

    with torch.inference_mode():
        greedy_plain(target, spec.prompts[0].token_ids, 4, eos, device)  # warm-up: lazy kernels, allocator
        spec.log(f"[acceptance] batched exact measurement: {len(spec.prompts)} prompts, batches of {spec.batch_size}")
        records, seconds = measure_batched(
            target, drafts, {"trained": spec.prompts, "untrained": spec.untrained_subset}, spec.prompts, k,
            spec.max_tokens, eos, spec.batch_size, device, pad_id=min(eos) if eos else 0)
        spec.log(f"[acceptance] batched parts (s): " + ", ".join(f"{n} {v:.2f}" for n, v in seconds.items()))
        spec.log(f"[acceptance] concurrency 1: chain speculation on {len(spec.concurrency_one)} prompts")
        chain = ChainSpeculator(target, drafts["trained"], k, device)
        c1, c1_wall = _one_at_a_time(lambda ids: chain.generate(ids, spec.max_tokens, eos), spec.concurrency_one)
    shared = seconds["generate"] + seconds["target"]
    runs = {
        "trained": RunResult(records=records["trained"], wall_s=shared + seconds["trained"], concurrency_one=c1,
                             concurrency_one_wall_s=c1_wall,
                             self_check=self_check(records["trained"], c1) if c1 else None),
        "untrained": RunResult(records=records["untrained"], wall_s=shared + seconds["untrained"]),
    }
    runs["trained"].parts_s = {**{n: round(v, 4) for n, v in seconds.items()},
                               "concurrency_one_chain": round(c1_wall, 4)}
    check = runs["trained"].self_check
    if check and not check["passed"]:
        spec.log(f"[acceptance] WARNING: batched records differ from chain speculation on {check['differing_ids']}")
    notes = ["transformers backend: exact greedy acceptance computed in batches (greedy generation, one "
             "teacher-forced target pass, k draft passes at every position; see self_check for its equality "
             "with step-by-step chain speculation); the batch throughput is not measured (no speculative "
             "serving engine); concurrency_1 compares chain speculation vs plain greedy decoding in the same "
             "Python loop, so it reflects this loop's overheads, not a serving engine's"]
    return runs, notes


@register("transformers", "speedup")
def measure_transformers_speedup(spec: MeasureSpec, engine_script: str | None = None) -> tuple[list[dict], dict]:
    """Interleaved rounds at concurrency 1: plain greedy vs chain speculation with the trained
    draft, one prompt at a time, in this process (no serving engine: no batch figure)."""
    import torch

    if not spec.concurrency_one:
        return [], {}
    target, device = _load_target(spec)
    eos = set(spec.eos_token_ids)
    draft = EagleDraft(load_draft_for_transformers(spec.draft, spec.target, getattr(torch, spec.dtype), device), device)
    chain = ChainSpeculator(target, draft, spec.num_speculative_tokens, device)

    def arm(fn):
        def timed():
            records, wall = _one_at_a_time(fn, spec.concurrency_one)
            steps = [s for r in records for s in request_steps(r)]
            return {"concurrency_1": {"output_tokens": sum(len(r.token_ids) for r in records), "wall_s": wall,
                                      "accepted": sum(a for a, _ in steps), "drafts": len(steps)}}
        return timed

    with torch.inference_mode():
        greedy_plain(target, spec.prompts[0].token_ids, 4, eos, device)  # warm-up: lazy kernels, allocator
        rounds = run_rounds({"without_draft": arm(lambda ids: greedy_plain(target, ids, spec.max_tokens, eos, device)),
                             "with_draft": arm(lambda ids: chain.generate(ids, spec.max_tokens, eos))},
                            spec.speedup_rounds, spec.log)
    return rounds, {}
