"""transformers backend: HF generate, for targets (or GPU boxes) vLLM cannot run."""
from __future__ import annotations

from typing import Any, Iterator

from .base import (ERROR_INVALID, ERROR_TRANSIENT, Backend, BackendUnavailable, Completion, PromptRequest,
                   prompt_error_types, register, vllm_tokenizer)
from ..errors import PipelineError


@register("transformers")
class TransformersBackend(Backend):
    """HF generate with static KV caches bucketed by length: on CUDA, transformers compiles the
    decoding step (torch.compile, CUDA graphs) once per shape and replays it, so every batch of
    one bucket must have the same shape. The prompts are sorted longest first and cut into
    batches of batch_size; each batch's cache is its longest prompt plus max_tokens rounded up
    to a power of two (at least MIN_CACHE_BUCKET), so short prompts don't attend over (and pay
    for) the longest prompt's cache: decoding reads the whole static cache every step. Few
    buckets means few compiles; a short warm-up generate compiles each new bucket before its
    first real batch (the seconds are summed as warmup_s). Every batch holds batch_size rows
    (a short one is filled up with copies of its last prompt, whose answers are dropped).
    Left padding; greedy (temperature 0) or sampled with torch seeded by `seed` before each batch
    (so sampled answers depend on the batch composition, unlike vLLM's per-request seeds). A
    batch that runs past request_timeout_s is cut (generate's max_time); its unfinished prompts
    are retried."""

    # Decode steps of the warm-up generate: the compiled step is captured and replayed by then.
    WARMUP_TOKENS = 4
    # The smallest static cache (tokens); larger caches double. 256 holds a chat prompt plus 128
    # new tokens; doubling keeps the number of compiled shapes to a handful.
    MIN_CACHE_BUCKET = 256

    def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..runtime import has_cuda, padded_batch_attention

        s = self.settings
        self.device = "cuda" if has_cuda() else "cpu"
        padded_batch_attention()
        self.log(f"[transformers] loading {self.target} (dtype {self.dtype}, {self.device})")
        self.tokenizer = AutoTokenizer.from_pretrained(self.target, trust_remote_code=s.trust_remote_code)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.target, dtype=getattr(torch, self.dtype),
                                                          trust_remote_code=s.trust_remote_code).to(self.device)
        self.model.eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if not self.eos_ids:
            raise PipelineError(f"{self.target}: neither generation_config.json nor the tokenizer names an "
                                f"eos token; the transformers backend cannot tell where answers stop")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        cfg = self.model.config.get_text_config()  # multimodal targets nest the text model's config
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        if s.reasoning_parser:
            self._make_splitter(vllm_tokenizer(self.target, s.trust_remote_code))
        self._prompt_errors = prompt_error_types()
        # Facts for the shard summary, filled in as batches run.
        self.stats: dict[str, Any] = {"decoding": "static cache", "warmup_s": 0.0, "batches": 0,
                                      "filler_rows": 0, "cache_len": None,
                                      "batches_per_cache_len": {}}
        self._warmed_up: set[int] = set()  # cache lengths compiled so far

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": str(self.target), "dtype": self.dtype, "device": self.device,
                **self.stats}

    def generate(self, requests: list[PromptRequest]) -> Iterator[Completion]:
        s = self.settings
        rendered: list[tuple[PromptRequest, list[int]]] = []
        for req in requests:
            try:
                rendered.append((req, self._render(req)))
            except self._prompt_errors as err:  # template errors, over-long prompts
                yield Completion.failed(req, err, ERROR_INVALID)
        if not rendered:
            return
        rendered.sort(key=lambda item: len(item[1]), reverse=True)  # batches of similar lengths
        for start in range(0, len(rendered), s.batch_size):
            chunk = rendered[start:start + s.batch_size]
            prompts = [ids for _, ids in chunk]
            cache_len = self.cache_len_for(len(prompts[0]))
            if self._compiles() and cache_len not in self._warmed_up:
                self._warm_up(prompts, cache_len)
            yield from self._generate_batch([r for r, _ in chunk], prompts, cache_len, self._compiles())

    def cache_len_for(self, longest_prompt: int) -> int:
        """The static cache of a batch whose longest prompt has this many tokens: prompt plus
        max_tokens, rounded up to MIN_CACHE_BUCKET * 2^k, within the target's context."""
        need = longest_prompt + self.settings.max_tokens
        cache_len = self.MIN_CACHE_BUCKET
        while cache_len < need:
            cache_len *= 2
        return min(cache_len, self.max_positions) if self.max_positions else cache_len

    def _compiles(self) -> bool:
        """Whether transformers will compile the decoding step (CUDA and a static cache)."""
        return self.device == "cuda" and not self.stats.get("compile_failed")

    def _render(self, req: PromptRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                                  **self.settings.chat_template_kwargs)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_positions and len(ids) >= self.max_positions:
            raise ValueError(f"the prompt has {len(ids)} tokens; the target's context is {self.max_positions}")
        return ids

    def _inputs(self, prompts: list[list[int]]):
        import torch

        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        return input_ids, mask, width

    def _generate_kwargs(self, max_new: int, cache_len: int) -> dict[str, Any]:
        s = self.settings
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new, eos_token_id=sorted(self.eos_ids),
                                      pad_token_id=self.pad_id, max_time=float(s.request_timeout_s),
                                      cache_implementation="static", max_cache_len=cache_len,
                                      disable_compile=not self._compiles())
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=float(s.temperature), top_p=float(s.top_p))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs

    def _warm_up(self, prompts: list[list[int]], cache_len: int) -> None:
        """One short generate on the first batch's shapes: transformers compiles the decoding
        step here, not inside the first real batch. If compiling fails (no working Triton,
        an unsupported op), decoding continues uncompiled rather than failing the job."""
        import time

        import torch

        prompts = prompts + [prompts[-1]] * (self.settings.batch_size - len(prompts))
        input_ids, mask, _ = self._inputs(prompts)
        t0 = time.monotonic()
        try:
            with torch.inference_mode():
                self.model.generate(input_ids=input_ids, attention_mask=mask,
                                    **self._generate_kwargs(self.WARMUP_TOKENS, cache_len))
            self._warmed_up.add(cache_len)
            self.stats["decoding"] = ("static caches bucketed by length, decoding step compiled by transformers "
                                      "(torch.compile)")
        except torch.OutOfMemoryError:
            raise BackendUnavailable(f"out of memory in a batch of {len(prompts)} prompts with a {cache_len}-token "
                                     f"static cache; lower generation.batch_size") from None
        except Exception as err:  # torch.compile raises many types (BackendCompilerFailed, Unsupported, ...)
            self.stats["compile_failed"] = f"{type(err).__name__}: {str(err)[:300]}"
            self.log(f"[transformers] compiling the decoding step failed ({self.stats['compile_failed']}); "
                     f"decoding uncompiled")
        self.stats["warmup_s"] = round(self.stats["warmup_s"] + time.monotonic() - t0, 3)
        self.log(f"[transformers] warm-up (compile) {time.monotonic() - t0:.1f} s; static cache {cache_len} tokens, "
                 f"batches of {len(prompts)}")

    def _generate_batch(self, batch: list[PromptRequest], prompts: list[list[int]], cache_len: int,
                        fill: bool) -> Iterator[Completion]:
        import torch

        s = self.settings
        filler = s.batch_size - len(prompts) if fill else 0  # same shape as every batch: no recompile
        input_ids, mask, width = self._inputs(prompts + [prompts[-1]] * filler)
        max_new = max(1, min(s.max_tokens, cache_len - width))
        if s.temperature > 0:
            torch.manual_seed(s.seed)
        try:
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                          **self._generate_kwargs(max_new, cache_len))
        except torch.OutOfMemoryError:
            raise BackendUnavailable(f"out of memory generating a batch of {len(batch)} prompts (longest "
                                     f"{width} tokens); lower generation.batch_size") from None
        self.stats["batches"] += 1
        self.stats["filler_rows"] += filler
        self.stats["cache_len"] = max(cache_len, self.stats["cache_len"] or 0)
        per_len = self.stats["batches_per_cache_len"]
        per_len[str(cache_len)] = per_len.get(str(cache_len), 0) + 1
        generated = out[:len(batch), width:].tolist()
        for req, prompt, tokens in zip(batch, prompts, generated):
            stop_at = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if stop_at is not None:
                kept, finish, count = tokens[:stop_at], "stop", stop_at + 1  # vLLM counts the eos token too
            elif len(tokens) >= max_new:
                kept, finish, count = tokens, "length", len(tokens)
            else:  # generate stopped on max_time before this row finished
                yield Completion.failed(req, f"no answer within request_timeout_s = {s.request_timeout_s}s "
                                             f"(batch of {len(batch)})", ERROR_TRANSIENT, len(prompt))
                continue
            text = self.tokenizer.decode(kept, skip_special_tokens=self.skip_special_tokens)
            reasoning, answer = self._split(text, req.messages)
            yield Completion(req, reasoning, answer, finish, len(prompt), count, token_ids=tokens[:count])


# The one place that maps `generation.backend` to an implementation.
