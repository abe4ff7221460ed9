"""transformers backend: HF generate, for targets (or GPU nodes) vLLM cannot run."""
from __future__ import annotations

import time
from typing import Any, Iterator

from . import graph_decode
from .base import (ERROR_INVALID, ERROR_TRANSIENT, Backend, BackendUnavailable, Completion, PromptRequest,
                   prompt_error_types, register, vllm_tokenizer)
from ..errors import PipelineError


@register("transformers")
class TransformersBackend(Backend):
    """Greedy answers come from the target's own forward in a decoding loop built for small
    targets on big GPUs (graph_decode: a static cache sized to each batch, the one-token step
    replayed as a CUDA graph, grouped-query attention without repeated K/V); sampled answers,
    and targets that loop cannot take (graph_decode.supports), from HF `generate` with its
    dynamic cache. Either way the prompts are sorted longest first and cut into batches of
    batch_size, so a batch's prompts have similar lengths (little padding) and short prompts
    never attend over the longest one's cache. On CUDA, cuDNN attention is off
    (runtime.padded_batch_attention). bench/traces_speed.py measures this backend next to
    `generate` alone on the same batches; bench/decode_designs.py the designs behind it.
    Sampling seeds torch with `seed` before each batch (so sampled answers depend on the batch
    composition, unlike vLLM's per-request seeds; a request's own `seed` is not used here). A batch that runs past request_timeout_s is
    cut (generate's max_time, the loop's deadline); its unfinished prompts are retried."""

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
        # The one place that picks the decoding loop (the reason is in the shard summary).
        why_not = "sampling (temperature > 0)" if s.temperature > 0 else graph_decode.supports(self.model)
        self.graph_decode = why_not is None
        if self.graph_decode:
            graph_decode.prepare(self.model)
            decoding = "greedy loop, static cache per batch" + (", CUDA graph" if self.device == "cuda" else "")
        else:
            decoding = f"HF generate, dynamic cache ({why_not})"
        self.log(f"[transformers] decoding: {decoding}")
        # Facts for the shard summary, filled in as batches run.
        self.stats: dict[str, Any] = {"decoding": decoding + ", batches sorted by prompt length",
                                      "batches": 0, "longest_batch_prompt": None}

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
            yield from self._generate_batch([r for r, _ in chunk], [ids for _, ids in chunk])

    def _render(self, req: PromptRequest) -> list[int]:
        if req.prompt_token_ids is not None:  # raw: rendered by the caller
            ids = list(req.prompt_token_ids)
        else:
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

    def _generate_kwargs(self, max_new: int) -> dict[str, Any]:
        s = self.settings
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new, eos_token_id=sorted(self.eos_ids),
                                      pad_token_id=self.pad_id, max_time=float(s.request_timeout_s))
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=float(s.temperature), top_p=float(s.top_p))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs

    def _generate_batch(self, batch: list[PromptRequest], prompts: list[list[int]]) -> Iterator[Completion]:
        import torch

        s = self.settings
        input_ids, mask, width = self._inputs(prompts)
        # Within the target's context: prompts are shorter than it (_render), answers may be cut.
        max_new = min(s.max_tokens, self.max_positions - width) if self.max_positions else s.max_tokens
        if s.temperature > 0:
            torch.manual_seed(s.seed)
        try:
            if self.graph_decode:
                generated = graph_decode.greedy_batch(self.model, input_ids, mask, max_new, self.eos_ids, self.pad_id,
                                                      deadline=time.monotonic() + s.request_timeout_s)
            else:
                with torch.inference_mode():
                    out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                              **self._generate_kwargs(max_new))
                generated = out[:len(batch), width:].tolist()
        except torch.OutOfMemoryError:
            raise BackendUnavailable(f"out of memory generating a batch of {len(batch)} prompts (longest "
                                     f"{width} tokens); lower generation.batch_size") from None
        self.stats["batches"] += 1
        self.stats["longest_batch_prompt"] = max(width, self.stats["longest_batch_prompt"] or 0)
        for req, prompt, tokens in zip(batch, prompts, generated):
            stop_at = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if stop_at is not None:
                kept, finish, count = tokens[:stop_at], "stop", stop_at + 1  # vLLM counts the eos token too
            elif len(tokens) >= max_new:
                kept, finish, count = tokens, "length", len(tokens)
            else:  # the batch ran past request_timeout_s before this row finished
                yield Completion.failed(req, f"no answer within request_timeout_s = {s.request_timeout_s}s "
                                             f"(batch of {len(batch)})", ERROR_TRANSIENT, len(prompt))
                continue
            text = self.tokenizer.decode(kept, skip_special_tokens=self.skip_special_tokens)
            reasoning, answer = self._split(text, req.messages)
            yield Completion(req, reasoning, answer, finish, len(prompt), count, token_ids=tokens[:count])


# The one place that maps `generation.backend` to an implementation.
