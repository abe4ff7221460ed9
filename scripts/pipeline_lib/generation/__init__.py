"""Generation backends for the traces stage: the target answers the training prompts.

Interchangeable backends, one module each, registered in BACKENDS (name -> class). Each one
turns PromptRequests into Completions with the same fields, so every backend writes the same
trace rows:

  vllm          vllm_backend.py: offline vLLM engine with the target's chat template
  openai        openai_backend.py: an OpenAI-compatible chat-completions endpoint
  transformers  transformers_backend.py: HF transformers, for targets vLLM cannot run

A new backend is one new module: subclass base.Backend, decorate it with @register("name"),
and import it below.

Reasoning: with `reasoning_parser` set, answers are split into (reasoning, answer) by vLLM's
own parser class of that name, applied to the generated text exactly as `vllm serve` applies it
(same parser, same skip_special_tokens decision). The openai backend takes the server's split
(`reasoning` field) when the server ran a parser.

Failure policy, applied by generate_with_retries():
  - one prompt fails: rejected by the backend (ERROR_INVALID, e.g. longer than the context)
    -> an error Completion at once; timed out or a server error (ERROR_TRANSIENT) -> retried
    `retries` times, then an error Completion. Error rows are kept, never dropped.
  - the backend itself is unusable: endpoint unreachable after `retries` retries, credentials
    or model name refused, engine dead -> BackendUnavailable: the job fails (rows already
    finished were handed to the caller, which keeps them in its row cache).
"""
from . import openai_backend, transformers_backend, vllm_backend  # noqa: F401  (each registers its backend)
from .base import (BACKENDS, ERROR_INVALID, ERROR_TRANSIENT, ERROR_UNREACHABLE, FINISH_REASONS,  # noqa: F401
                   Backend, BackendUnavailable, Completion, GenerationSettings, PromptRequest, ReasoningSplitter,
                   RunCounts, error_label, generate_with_retries, make_backend, redact_url)
