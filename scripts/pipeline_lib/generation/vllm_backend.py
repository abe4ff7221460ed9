"""vLLM backend: the offline engine with the target's chat template (continuous batching)."""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterator

from .base import (ERROR_INVALID, ERROR_TRANSIENT, Backend, BackendUnavailable, Completion, PromptRequest,
                   log_traceback, prompt_error_types, register)


@register("vllm")
class VllmBackend(Backend):
    """Offline vLLM. Requests go through LLM.enqueue_chat (the target's chat template, as
    LLM.chat renders it; raw token-id prompts through LLM.enqueue) and the engine is stepped here rather than inside LLM.chat, so that
    each answer is handed over (and cached) the moment it finishes, at most batch_size
    prompts are in flight, and a request past request_timeout_s is aborted."""

    def start(self) -> None:
        from ..parallel import decide
        from ..runtime import vllm_engine_in_process

        self.in_process = in_process = vllm_engine_in_process()
        from vllm import LLM, SamplingParams

        s = self.settings
        self.parallel = layout = decide().apply()
        # CUDA graphs pay off over a long decode on GPU; on CPU eager mode starts 3x faster.
        eager = layout.gpus == 0
        self.log(f"[vllm] loading {self.target} (dtype {self.dtype}, {layout.provenance()}, "
                 f"{'eager' if eager else 'CUDA graphs'}, engine {'in this process' if in_process else 'in a process of its own'})")
        try:
            self.llm = LLM(model=str(self.target), tokenizer=str(self.target), dtype=self.dtype,
                           enforce_eager=eager, seed=s.seed, trust_remote_code=s.trust_remote_code,
                           **layout.engine_kwargs())
        except Exception as err:
            log_traceback(self.log)
            raise BackendUnavailable(f"vLLM could not load the target {self.target}: {type(err).__name__}: "
                                     f"{err}; see the traceback above in this job's log") from None
        try:  # vLLM >= 0.27: the base class of errors a request causes
            from vllm.exceptions import VLLMClientError
            request_errors: tuple[type, ...] = (VLLMClientError,)
        except ImportError:  # vLLM 0.26 (the GPU node's): its request errors are ValueErrors
            request_errors = ()
        self._prompt_errors = prompt_error_types(*request_errors)
        self._make_splitter(self.llm.get_tokenizer())
        # Start from the target's own generation defaults (generation_config.json: top_k,
        # repetition_penalty, ...) as `vllm serve` and LLM.chat do, then apply ours.
        defaults = self.llm.model_config.get_diff_sampling_param()
        self.params = SamplingParams.from_optional(**{
            **defaults, "temperature": float(s.temperature), "top_p": float(s.top_p), "max_tokens": s.max_tokens,
            "seed": s.seed, "skip_special_tokens": self.skip_special_tokens})

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": str(self.target), "dtype": self.dtype,
                "engine_in_process": self.in_process, "parallel": self.parallel.provenance()}  # describe() comes after start()

    def generate(self, requests: list[PromptRequest]) -> Iterator[Completion]:
        s = self.settings
        engine = self.llm.llm_engine
        queue = deque(requests)
        in_flight: dict[str, tuple[PromptRequest, str, float]] = {}  # external id -> (req, internal id, t0)
        try:
            while queue or in_flight:
                while queue and len(in_flight) < s.batch_size:
                    req = queue.popleft()
                    try:
                        [internal_id] = self._enqueue(req)
                    except self._prompt_errors as err:  # e.g. longer than the context
                        yield Completion.failed(req, err, ERROR_INVALID)
                        continue
                    except Exception as err:  # the engine, not the prompt (e.g. EngineDeadError)
                        log_traceback(self.log)
                        raise BackendUnavailable(f"vLLM could not take requests: {type(err).__name__}: {err}") from None
                    in_flight[_external_request_id(internal_id)] = (req, internal_id, time.monotonic())
                if not in_flight:
                    continue
                try:
                    outputs = engine.step()
                except Exception as err:
                    log_traceback(self.log)
                    raise BackendUnavailable(f"the vLLM engine failed: {type(err).__name__}: {err}") from None
                for out in outputs:
                    if out.finished and out.request_id in in_flight:
                        req, _, _ = in_flight.pop(out.request_id)
                        yield self._completion(req, out)
                now = time.monotonic()
                expired = [k for k, (_, _, t0) in in_flight.items() if now - t0 > s.request_timeout_s]
                if expired:
                    engine.abort_request([in_flight[k][1] for k in expired], internal=True)
                    for k in expired:
                        req = in_flight.pop(k)[0]
                        yield Completion.failed(req, f"no answer within request_timeout_s = {s.request_timeout_s}s",
                                                ERROR_TRANSIENT)
        finally:
            if in_flight:  # the consumer stopped early (e.g. a fatal error): free the engine
                engine.abort_request([v[1] for v in in_flight.values()], internal=True)

    def _enqueue(self, req: PromptRequest) -> list[str]:
        """Chat requests through the target's chat template (as LLM.chat renders it); raw ones
        (prompt_token_ids) as they are, with their own seed where they carry one."""
        if req.prompt_token_ids is None:
            return self.llm.enqueue_chat([req.messages], self.params, use_tqdm=False,
                                         chat_template_kwargs=self.settings.chat_template_kwargs or None)
        params = self.params
        if req.seed is not None:
            params = params.clone()
            params.seed = req.seed
        return self.llm.enqueue([{"prompt_token_ids": list(req.prompt_token_ids)}], params, use_tqdm=False)

    def _completion(self, req: PromptRequest, out: Any) -> Completion:
        choice = out.outputs[0]
        prompt_tokens = len(out.prompt_token_ids or [])
        if choice.finish_reason not in ("stop", "length"):
            return Completion.failed(req, f"vLLM finished the request with finish_reason={choice.finish_reason!r}",
                                     ERROR_TRANSIENT, prompt_tokens)
        reasoning, answer = self._split(choice.text, req.messages)
        return Completion(req, reasoning, answer, choice.finish_reason, prompt_tokens, len(choice.token_ids),
                          token_ids=list(choice.token_ids))


def _external_request_id(internal_id: str) -> str:
    # LLM.enqueue_chat returns the engine's internal id "<counter>-<8 random chars>", while
    # step() outputs carry the external id "<counter>" (vllm/v1/engine/input_processor.py).
    return internal_id.rsplit("-", 1)[0]

