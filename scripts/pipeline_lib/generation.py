"""Generation backends for the traces stage: the target answers the training prompts.

Three interchangeable backends behind BACKENDS (name -> class). Each one turns PromptRequests
into Completions with the same fields, so every backend writes the same trace rows:

  vllm          offline vLLM engine with the target's chat template (continuous batching)
  openai        an OpenAI-compatible chat-completions endpoint (`vllm serve`, SGLang, ...)
  transformers  HF `generate`, batched with left padding, for targets vLLM cannot run

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
from __future__ import annotations

import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

from .errors import PipelineError
from .provenance import scrub

# Why a prompt failed; decides whether retrying can help.
ERROR_INVALID = "invalid"          # the backend rejected this prompt: retrying cannot help
ERROR_TRANSIENT = "transient"      # timeout or server error: retry
ERROR_UNREACHABLE = "unreachable"  # the backend cannot be reached: retry, then fail the job

FINISH_REASONS = ("stop", "length", "error")


class BackendUnavailable(PipelineError):
    """The backend as a whole cannot serve requests; the job must fail (not record rows)."""


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class GenerationSettings:
    """The `generation` config section (defaults as in schemas/config.schema.yaml) plus
    `trust_remote_code` from the target section."""

    backend: str = "vllm"
    endpoint: str | None = None
    model_name: str | None = None
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    reasoning_parser: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    num_shards: int = 1
    batch_size: int = 64
    request_timeout_s: float = 600.0
    retries: int = 2
    trust_remote_code: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerationSettings":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise PipelineError(f"generation settings: unknown key(s) {unknown}; known keys: {sorted(known)}")
        s = cls(**raw)
        s._validate()
        return s

    def _validate(self) -> None:
        def bad(key: str, why: str) -> PipelineError:
            return PipelineError(f"setting generation.{key} = {getattr(self, key)!r}: {why}; fix it in config.yaml")

        if self.backend not in BACKENDS:
            raise bad("backend", f"unknown backend; choose one of {sorted(BACKENDS)}")
        for key, minimum in (("max_tokens", 1), ("num_shards", 1), ("batch_size", 1), ("retries", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise bad(key, f"must be an integer >= {minimum}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise bad("seed", "must be an integer")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.request_timeout_s, (int, float)) or self.request_timeout_s <= 0:
            raise bad("request_timeout_s", "must be a number of seconds > 0")
        if not isinstance(self.chat_template_kwargs, dict):
            raise bad("chat_template_kwargs", "must be a mapping")
        if self.backend == "openai" and not self.endpoint:
            raise bad("endpoint", "the openai backend needs the server's base URL, e.g. http://127.0.0.1:8000/v1")

    def sampling(self) -> dict[str, Any]:
        """What each trace row records as `sampling`."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "seed": self.seed}

    def answer_defining(self) -> dict[str, Any]:
        """The settings that change what the target answers (and how it is split); the row
        cache keys on these. Batch size, timeouts, shard count, backend and endpoint only
        change how the answers are obtained."""
        return {**self.sampling(), "chat_template_kwargs": self.chat_template_kwargs,
                "reasoning_parser": self.reasoning_parser}

    def public(self) -> dict[str, Any]:
        """Settings as recorded in summaries/provenance (credentials stripped from the URL)."""
        out = asdict(self)
        out["endpoint"] = redact_url(self.endpoint) if self.endpoint else None
        return out


def redact_url(url: str) -> str:
    """The URL without user:password@ and without a query string (both may hold secrets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class PromptRequest:
    id: str
    messages: list[dict[str, Any]]


@dataclass
class Completion:
    request: PromptRequest
    reasoning: str | None = None
    answer: str | None = None
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, request: PromptRequest, error: str | BaseException, kind: str,
               prompt_tokens: int = 0) -> "Completion":
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return cls(request, finish_reason="error", error=scrub(text)[:2000], error_kind=kind,
                   prompt_tokens=prompt_tokens)


def _none_if_empty(text: str | None) -> str | None:
    return text if text else None


# --------------------------------------------------------------------------- reasoning

class ReasoningSplitter:
    """Splits generated text into (reasoning, answer) with vLLM's reasoning parser `name`,
    constructed and called the way vLLM's chat-completions server does it."""

    def __init__(self, name: str, tokenizer: Any, chat_template_kwargs: dict[str, Any]):
        try:
            from vllm.reasoning import ReasoningParserManager
        except ImportError as err:
            raise PipelineError(f"setting generation.reasoning_parser = {name!r} uses vLLM's reasoning "
                                f"parsers, but vLLM is not importable here ({err}); install vllm or "
                                f"set reasoning_parser: null") from None
        try:
            self._cls = ReasoningParserManager.get_reasoning_parser(name)
        except KeyError:
            raise PipelineError(f"setting generation.reasoning_parser = {name!r} is not a vLLM reasoning "
                                f"parser; choose one of {ReasoningParserManager.list_registered()}") from None
        self.name = name
        self._tokenizer = tokenizer
        self._kwargs = dict(chat_template_kwargs)
        try:
            probe = self._parser()
        except Exception as err:  # e.g. the tokenizer lacks the parser's <think> tokens
            raise PipelineError(f"setting generation.reasoning_parser = {name!r} does not fit the target's "
                                f"tokenizer: {err}; pick the parser made for this model family") from None
        # The server lets the parser adjust each request; engine-based parsers (e.g. qwen3)
        # turn skip_special_tokens off so their markers survive detokenization. Offline
        # decoding must do the same to split identically.
        adjusted = probe.adjust_request(self._request([{"role": "user", "content": "."}]))
        self.skip_special_tokens = bool(getattr(adjusted, "skip_special_tokens", True))
        self.markers = tuple(m for m in (probe.reasoning_start_str, probe.reasoning_end_str) if m)

    def _parser(self):
        # Parsers keep per-response state: one instance per response, as the server does.
        return self._cls(self._tokenizer, chat_template_kwargs=self._kwargs)

    def _request(self, messages: list[dict[str, Any]]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest(model="target", messages=messages, chat_template_kwargs=self._kwargs)

    def split(self, text: str, messages: list[dict[str, Any]]) -> tuple[str | None, str | None]:
        reasoning, answer = self._parser().extract_reasoning(text, self._request(messages))
        return _none_if_empty(reasoning), _none_if_empty(answer)


# --------------------------------------------------------------------------- backends

class Backend:
    """Common frame: settings, the target, and the reasoning split. Subclasses implement
    start() (load or connect; may raise PipelineError/BackendUnavailable) and generate()
    (yield exactly one Completion per request, in completion order)."""

    name = ""

    def __init__(self, settings: GenerationSettings, target_dir: str | Path, dtype: str,
                 log: Callable[[str], None] = print):
        self.settings = settings
        self.target = Path(target_dir)
        self.dtype = dtype
        self.log = log
        self.splitter: ReasoningSplitter | None = None

    def start(self) -> None:
        raise NotImplementedError

    def generate(self, requests: list[PromptRequest]) -> Iterator[Completion]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def retry_delay_s(self, attempt: int) -> float:
        return 0.0

    def describe(self) -> dict[str, Any]:
        """Facts about what generated the rows, for the shard summary."""
        return {"backend": self.name}

    def _make_splitter(self, tokenizer: Any) -> None:
        if self.settings.reasoning_parser:
            self.splitter = ReasoningSplitter(self.settings.reasoning_parser, tokenizer,
                                              self.settings.chat_template_kwargs)

    @property
    def skip_special_tokens(self) -> bool:
        return self.splitter.skip_special_tokens if self.splitter else True

    def _split(self, text: str, messages: list[dict[str, Any]]) -> tuple[str | None, str | None]:
        if self.splitter is None:
            return None, _none_if_empty(text)
        return self.splitter.split(text, messages)


def _log_traceback(log: Callable[[str], None]) -> None:
    log(traceback.format_exc().rstrip())


def _prompt_error_types(*extra: type) -> tuple[type, ...]:
    """Exceptions that condemn one prompt (bad template input, too long, rejected by request
    validation), as opposed to a broken backend, which must fail the job instead of being
    recorded - and cached - as that prompt's error."""
    from jinja2 import TemplateError

    return (ValueError, TypeError, KeyError, TemplateError, *extra)


def _visible_gpu_count() -> int:
    from .runtime import has_cuda

    if not has_cuda():
        return 0
    import torch

    return torch.cuda.device_count()


class VllmBackend(Backend):
    """Offline vLLM. Requests go through LLM.enqueue_chat (the target's chat template, as
    LLM.chat renders it) and the engine is stepped here rather than inside LLM.chat, so that
    each answer is handed over (and cached) the moment it finishes, at most batch_size
    prompts are in flight, and a request past request_timeout_s is aborted."""

    name = "vllm"

    def start(self) -> None:
        from vllm import LLM, SamplingParams

        s = self.settings
        gpus = _visible_gpu_count()
        # CUDA graphs pay off over a long decode on GPU; on CPU eager mode starts 3x faster.
        eager = gpus == 0
        self.log(f"[vllm] loading {self.target} (dtype {self.dtype}, {gpus or 'no'} GPU(s), "
                 f"{'eager' if eager else 'CUDA graphs'})")
        try:
            self.llm = LLM(model=str(self.target), tokenizer=str(self.target), dtype=self.dtype,
                           enforce_eager=eager, seed=s.seed, trust_remote_code=s.trust_remote_code,
                           tensor_parallel_size=max(gpus, 1))
        except Exception as err:
            _log_traceback(self.log)
            raise BackendUnavailable(f"vLLM could not load the target {self.target}: {type(err).__name__}: "
                                     f"{err}; see the traceback above in this job's log") from None
        from vllm.exceptions import VLLMClientError

        self._prompt_errors = _prompt_error_types(VLLMClientError)
        self._make_splitter(self.llm.get_tokenizer())
        # Start from the target's own generation defaults (generation_config.json: top_k,
        # repetition_penalty, ...) as `vllm serve` and LLM.chat do, then apply ours.
        defaults = self.llm.model_config.get_diff_sampling_param()
        self.params = SamplingParams.from_optional(**{
            **defaults, "temperature": float(s.temperature), "top_p": float(s.top_p), "max_tokens": s.max_tokens,
            "seed": s.seed, "skip_special_tokens": self.skip_special_tokens})

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": str(self.target), "dtype": self.dtype}

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
                        [internal_id] = self.llm.enqueue_chat([req.messages], self.params, use_tqdm=False,
                                                              chat_template_kwargs=s.chat_template_kwargs or None)
                    except self._prompt_errors as err:  # e.g. longer than the context
                        yield Completion.failed(req, err, ERROR_INVALID)
                        continue
                    except Exception as err:  # the engine, not the prompt (e.g. EngineDeadError)
                        _log_traceback(self.log)
                        raise BackendUnavailable(f"vLLM could not take requests: {type(err).__name__}: {err}") from None
                    in_flight[_external_request_id(internal_id)] = (req, internal_id, time.monotonic())
                if not in_flight:
                    continue
                try:
                    outputs = engine.step()
                except Exception as err:
                    _log_traceback(self.log)
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

    def _completion(self, req: PromptRequest, out: Any) -> Completion:
        choice = out.outputs[0]
        prompt_tokens = len(out.prompt_token_ids or [])
        if choice.finish_reason not in ("stop", "length"):
            return Completion.failed(req, f"vLLM finished the request with finish_reason={choice.finish_reason!r}",
                                     ERROR_TRANSIENT, prompt_tokens)
        reasoning, answer = self._split(choice.text, req.messages)
        return Completion(req, reasoning, answer, choice.finish_reason, prompt_tokens, len(choice.token_ids))


def _external_request_id(internal_id: str) -> str:
    # LLM.enqueue_chat returns the engine's internal id "<counter>-<8 random chars>", while
    # step() outputs carry the external id "<counter>" (vllm/v1/engine/input_processor.py).
    return internal_id.rsplit("-", 1)[0]


class OpenAIBackend(Backend):
    """Chat completions against an OpenAI-compatible endpoint, batch_size requests at a time.
    The API key, if the server wants one, comes from $OPENAI_API_KEY (never from settings,
    so it never lands in configs, logs or provenance)."""

    name = "openai"

    def start(self) -> None:
        import os

        import httpx

        s = self.settings
        self.base_url = _api_base(s.endpoint)
        self.shown_url = redact_url(self.base_url)
        headers = {}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        self.client = httpx.Client(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(s.request_timeout_s, connect=min(10.0, s.request_timeout_s)),
            limits=httpx.Limits(max_connections=s.batch_size, max_keepalive_connections=s.batch_size))
        self.model = self._resolve_model()
        self.log(f"[openai] {self.shown_url} serves {self.model!r}")

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()

    def retry_delay_s(self, attempt: int) -> float:
        return min(2.0 ** attempt, 30.0)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "endpoint": self.shown_url, "model": self.model}

    def _resolve_model(self) -> str:
        """GET /models: proves the endpoint is up (with retries) and names the served model."""
        import httpx

        s = self.settings
        attempts = s.retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry_delay_s(attempt))
            try:
                r = self.client.get("/models", timeout=min(30.0, s.request_timeout_s))
            except httpx.TransportError as err:
                last = f"{type(err).__name__}: {err}"
                self.log(f"[openai] attempt {attempt + 1}/{attempts}: {self.shown_url} unreachable ({last})")
                continue
            if r.status_code >= 500:
                last = f"HTTP {r.status_code}"
                continue
            self._raise_for_fatal_status(r, "GET /models")
            if r.status_code == 404 and s.model_name:  # some servers have no /models
                return s.model_name
            if r.status_code != 200:
                raise BackendUnavailable(f"{self.shown_url}/models answered HTTP {r.status_code}: "
                                         f"{scrub(r.text[:300])}; is generation.endpoint an OpenAI-compatible API?")
            served = [m.get("id") for m in r.json().get("data", [])]
            if s.model_name:
                if s.model_name not in served:
                    raise BackendUnavailable(f"setting generation.model_name = {s.model_name!r} is not served "
                                             f"at {self.shown_url} (it serves {served}); fix model_name")
                return s.model_name
            if len(served) != 1:
                raise BackendUnavailable(f"{self.shown_url} serves {len(served)} models {served}; set "
                                         f"generation.model_name to the one that is the target")
            return served[0]
        raise BackendUnavailable(
            f"generation.endpoint {self.shown_url} is unreachable after {attempts} attempt(s) "
            f"(retries = {s.retries}; last error: {last}); start the server or fix generation.endpoint")

    def _raise_for_fatal_status(self, r: Any, what: str) -> None:
        # Wrong credentials or model name fail every request alike: fail the job, not the row.
        if r.status_code in (401, 403):
            raise BackendUnavailable(f"{self.shown_url} refused {what} (HTTP {r.status_code}); set the "
                                     f"endpoint's API key in $OPENAI_API_KEY")
        if r.status_code == 404 and what != "GET /models":
            raise BackendUnavailable(f"{self.shown_url} answered {what} with HTTP 404 ({scrub(r.text[:300])}); "
                                     f"check generation.endpoint and generation.model_name")

    def generate(self, requests: list[PromptRequest]) -> Iterator[Completion]:
        if not requests:
            return
        pool = ThreadPoolExecutor(max_workers=min(self.settings.batch_size, len(requests)),
                                  thread_name_prefix="chat")
        try:
            futures = [pool.submit(self._chat, req) for req in requests]
            for fut in as_completed(futures):
                yield fut.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _chat(self, req: PromptRequest) -> Completion:
        import httpx

        s = self.settings
        body: dict[str, Any] = {"model": self.model, "messages": req.messages, "max_tokens": s.max_tokens,
                                "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}
        if s.chat_template_kwargs:
            body["chat_template_kwargs"] = s.chat_template_kwargs
        try:
            r = self.client.post("/chat/completions", json=body)
        except httpx.ConnectTimeout as err:
            return Completion.failed(req, f"{self.shown_url} unreachable: {err}", ERROR_UNREACHABLE)
        except httpx.TimeoutException:
            return Completion.failed(req, f"no answer within request_timeout_s = {s.request_timeout_s}s",
                                     ERROR_TRANSIENT)
        except httpx.ConnectError as err:
            return Completion.failed(req, f"{self.shown_url} unreachable: {err}", ERROR_UNREACHABLE)
        except httpx.TransportError as err:
            return Completion.failed(req, err, ERROR_TRANSIENT)
        self._raise_for_fatal_status(r, "POST /chat/completions")
        if r.status_code != 200:
            kind = ERROR_TRANSIENT if r.status_code in (408, 429) or r.status_code >= 500 else ERROR_INVALID
            return Completion.failed(req, f"HTTP {r.status_code}: {_error_text(r)}", kind)
        try:
            data = r.json()
            choice = data["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as err:
            return Completion.failed(req, f"malformed response ({err}): {r.text[:300]}", ERROR_TRANSIENT)
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        finish = {"tool_calls": "stop", "function_call": "stop"}.get(choice.get("finish_reason"),
                                                                     choice.get("finish_reason"))
        if finish not in ("stop", "length"):
            return Completion.failed(req, f"the server finished with finish_reason={finish!r}", ERROR_TRANSIENT,
                                     prompt_tokens)
        reasoning, answer = self._server_split(message, req.messages)
        return Completion(req, reasoning, answer, finish, prompt_tokens, int(usage.get("completion_tokens") or 0))

    def _server_split(self, message: dict[str, Any], messages: list[dict[str, Any]]):
        content = message.get("content") or ""
        server_reasoning = message.get("reasoning") or message.get("reasoning_content")
        if server_reasoning is not None or not self.settings.reasoning_parser:
            # The server ran a reasoning parser (vLLM: `reasoning`; older servers:
            # `reasoning_content`), or no split is wanted.
            return _none_if_empty(server_reasoning), _none_if_empty(content)
        # The server ran no parser. Split locally only when the reasoning markup is visibly
        # in the text: re-parsing an already-split answer would turn it into reasoning.
        if self.splitter is None:
            self._make_splitter(_vllm_tokenizer(self.target, self.settings.trust_remote_code))
        if any(m in content for m in self.splitter.markers):
            return self.splitter.split(content, messages)
        return None, _none_if_empty(content)


def _api_base(endpoint: str) -> str:
    """Accepts http://host:port or http://host:port/v1 (with or without a trailing slash)."""
    url = endpoint.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise PipelineError(f"setting generation.endpoint = {redact_url(endpoint)!r} is not an http(s) URL; "
                            f"use e.g. http://127.0.0.1:8000/v1")
    return url if url.endswith("/v1") else url + "/v1"


def _error_text(r: Any) -> str:
    try:
        err = r.json()
        msg = err.get("error", err)
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
        return scrub(str(msg))[:1000]
    except ValueError:
        return scrub(r.text[:1000])


def _vllm_tokenizer(target: Path, trust_remote_code: bool) -> Any:
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # the splitter itself reports the missing vLLM clearly
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    return get_tokenizer(str(target), trust_remote_code=trust_remote_code)


class TransformersBackend(Backend):
    """HF generate: batches of batch_size prompts, left padding, greedy (temperature 0) or
    sampled with torch seeded by `seed` before each batch (so sampled answers depend on the
    batch composition, unlike vLLM's per-request seeds). A batch that runs past
    request_timeout_s is cut (generate's max_time); its unfinished prompts are retried."""

    name = "transformers"

    def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .runtime import has_cuda

        s = self.settings
        self.device = "cuda" if has_cuda() else "cpu"
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
            self._make_splitter(_vllm_tokenizer(self.target, s.trust_remote_code))
        self._prompt_errors = _prompt_error_types()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": str(self.target), "dtype": self.dtype, "device": self.device}

    def generate(self, requests: list[PromptRequest]) -> Iterator[Completion]:
        s = self.settings
        for start in range(0, len(requests), s.batch_size):
            batch, prompts = [], []
            for req in requests[start:start + s.batch_size]:
                try:
                    ids = self._render(req)
                except self._prompt_errors as err:  # template errors, over-long prompts
                    yield Completion.failed(req, err, ERROR_INVALID)
                    continue
                batch.append(req)
                prompts.append(ids)
            if batch:
                yield from self._generate_batch(batch, prompts)

    def _render(self, req: PromptRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                                  **self.settings.chat_template_kwargs)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_positions and len(ids) >= self.max_positions:
            raise ValueError(f"the prompt has {len(ids)} tokens; the target's context is {self.max_positions}")
        return ids

    def _generate_batch(self, batch: list[PromptRequest], prompts: list[list[int]]) -> Iterator[Completion]:
        import torch

        s = self.settings
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        max_new = s.max_tokens
        if self.max_positions:
            max_new = max(1, min(max_new, self.max_positions - width))
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new, eos_token_id=sorted(self.eos_ids),
                                      pad_token_id=self.pad_id, max_time=float(s.request_timeout_s))
        if s.temperature > 0:
            torch.manual_seed(s.seed)
            kwargs.update(do_sample=True, temperature=float(s.temperature), top_p=float(s.top_p))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        try:
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
        except torch.OutOfMemoryError:
            raise BackendUnavailable(f"out of memory generating a batch of {len(batch)} prompts (longest "
                                     f"{width} tokens); lower generation.batch_size") from None
        generated = out[:, width:].tolist()
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
            yield Completion(req, reasoning, answer, finish, len(prompt), count)


# The one place that maps `generation.backend` to an implementation.
BACKENDS: dict[str, type[Backend]] = {
    "vllm": VllmBackend,
    "openai": OpenAIBackend,
    "transformers": TransformersBackend,
}


def make_backend(settings: GenerationSettings, target_dir: str | Path, dtype: str,
                 log: Callable[[str], None] = print) -> Backend:
    return BACKENDS[settings.backend](settings, target_dir, dtype, log)


# --------------------------------------------------------------------------- retries

@dataclass
class RunCounts:
    attempted: int = 0
    ok: int = 0
    failed: int = 0
    transient_failures: int = 0
    retried: int = 0
    first_transient_error: str | None = None


def generate_with_retries(backend: Backend, requests: Iterable[PromptRequest], retries: int,
                          on_done: Callable[[Completion], None],
                          log: Callable[[str], None] = print,
                          sleep: Callable[[float], None] = time.sleep) -> RunCounts:
    """Run every request through the backend; hand each final Completion to on_done as soon
    as it is final. See the module docstring for what is retried and what fails the job."""
    pending = list(requests)
    counts = RunCounts(attempted=len(pending))
    for attempt in range(retries + 1):
        if attempt:
            delay = backend.retry_delay_s(attempt)
            log(f"[retry {attempt}/{retries}] {len(pending)} prompt(s) again"
                + (f" in {delay:.0f}s" if delay else ""))
            sleep(delay)
            counts.retried += len(pending)
        again: list[PromptRequest] = []
        last_attempt = attempt == retries
        for c in backend.generate(pending):
            if c.ok:
                counts.ok += 1
                on_done(c)
                continue
            if c.error_kind == ERROR_UNREACHABLE and last_attempt:
                raise BackendUnavailable(f"the {backend.name} backend became unreachable and stayed so for "
                                         f"{retries + 1} attempt(s): {c.error}")
            if c.error_kind in (ERROR_TRANSIENT, ERROR_UNREACHABLE) and not last_attempt:
                again.append(c.request)
                continue
            counts.failed += 1
            if c.error_kind != ERROR_INVALID:
                counts.transient_failures += 1
                counts.first_transient_error = counts.first_transient_error or f"{c.request.id}: {c.error}"
            on_done(c)
        pending = again
        if not pending:
            break
    if counts.attempted and counts.ok == 0 and counts.transient_failures:
        # Every prompt failed and not because the prompts are bad: the backend is broken.
        raise BackendUnavailable(f"the {backend.name} backend failed all {counts.attempted} prompt(s) "
                                 f"after {retries} retries (e.g. {counts.first_transient_error})")
    return counts
