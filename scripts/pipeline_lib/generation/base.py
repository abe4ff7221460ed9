"""The frame every generation backend shares: settings, request/completion records, the
reasoning split, the Backend base class with its registry, and the retry loop.

A backend is one module in this package that subclasses Backend and registers itself with
@register("name"); see vllm_backend.py, openai_backend.py, transformers_backend.py.
"""
from __future__ import annotations

import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

from ..cli import reject_unknown_keys
from ..errors import PipelineError
from ..secrets import scrub

# Why a prompt failed; decides whether retrying can help.
ERROR_INVALID = "invalid"          # the backend rejected this prompt: retrying cannot help
ERROR_TRANSIENT = "transient"      # timeout or server error: retry
ERROR_UNREACHABLE = "unreachable"  # the backend cannot be reached: retry, then fail the job

FINISH_REASONS = ("stop", "length", "error")
# A server's Retry-After is honoured up to this long per retry round (a misconfigured server
# asking for hours must not park the job silently; the retry budget still bounds the total).
MAX_RETRY_AFTER_S = 300.0
TURNS = ("first", "all")                # generation.turns
ANSWER_SOURCES = ("target", "dataset")  # generation.source


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
    turns: str = "first"
    max_turns: int | None = None
    source: str = "target"
    trust_remote_code: bool = False
    # What the target computes in (the workflow resolves `auto`: pipeline_lib/dtypes.py);
    # None = the target's stored dtype (its manifest's), as before the setting existed.
    dtype: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerationSettings":
        reject_unknown_keys(raw, set(cls.__dataclass_fields__), "generation")
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
        if self.turns not in TURNS:
            raise bad("turns", f"choose one of {list(TURNS)}")
        if self.source not in ANSWER_SOURCES:
            raise bad("source", f"choose one of {list(ANSWER_SOURCES)}")
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or isinstance(self.max_turns, bool)
                                           or self.max_turns < 1):
            raise bad("max_turns", "must be an integer >= 1 or null")
        if self.dtype not in (None, "bfloat16", "float16", "float32"):
            raise bad("dtype", "give bfloat16, float16 or float32 (the workflow resolves auto; "
                               "leave it out to compute in the target's stored dtype)")
        if self.backend == "openai" and not self.endpoint:
            raise bad("endpoint", "the openai backend needs the server's base URL, e.g. http://127.0.0.1:8000/v1")

    def sampling(self) -> dict[str, Any]:
        """What each trace row records as `sampling`."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "seed": self.seed}

    def turns_to_answer(self, user_turns: int) -> int:
        """How many of a conversation's user turns get an answer."""
        if self.turns == "first":
            return min(1, user_turns)
        return min(user_turns, self.max_turns or user_turns)

    def answer_defining(self) -> dict[str, Any]:
        """The settings that change what the target answers (and how it is split); the row
        cache keys on these. Batch size, timeouts, shard count, backend and endpoint only
        change how the answers are obtained; turns/max_turns only which requests are made
        (each turn's request, earlier answers included, is its own cache key)."""
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
    # The raw path: a prompt already rendered to token ids, sent as it is (no chat template is
    # applied; `messages` is then empty). The synthesize stage renders the target's template up
    # to an open user turn itself. Backends without it (openai) refuse such requests.
    prompt_token_ids: list[int] | None = None
    # A sampling seed of this request's own (vLLM), so that many requests with one prompt
    # sample differently yet reproducibly; None = the settings' seed.
    seed: int | None = None


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
    retry_after_s: float | None = None  # the server asked to wait this long before retrying
    # The ids the target emitted (end-of-turn token included when it stopped); None where the
    # backend cannot return them. Tokenization splices these instead of re-encoding the text.
    token_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, request: PromptRequest, error: str | BaseException, kind: str,
               prompt_tokens: int = 0, retry_after_s: float | None = None) -> "Completion":
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return cls(request, finish_reason="error", error=scrub(text)[:2000], error_kind=kind,
                   prompt_tokens=prompt_tokens, retry_after_s=retry_after_s)


def error_label(error: str) -> str:
    """The class of an error message, for counting: what precedes its first ':' ("HTTP 429",
    "timeout", "malformed response", ...)."""
    head = error.split(":", 1)[0]
    return head if len(head) <= 60 else head[:60] + "..."


def none_if_empty(text: str | None) -> str | None:
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
        return none_if_empty(reasoning), none_if_empty(answer)


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
            return None, none_if_empty(text)
        return self.splitter.split(text, messages)



def log_traceback(log: Callable[[str], None]) -> None:
    log(traceback.format_exc().rstrip())


def prompt_error_types(*extra: type) -> tuple[type, ...]:
    """Exceptions that condemn one prompt (bad template input, too long, rejected by request
    validation), as opposed to a broken backend, which must fail the job instead of being
    recorded - and cached - as that prompt's error."""
    from jinja2 import TemplateError

    return (ValueError, TypeError, KeyError, TemplateError, *extra)


# The one place that maps `generation.backend` to an implementation: each backend module
# registers its class here when the package is imported.
BACKENDS: dict[str, type[Backend]] = {}


def register(name: str):
    def deco(cls: type[Backend]) -> type[Backend]:
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return deco


def make_backend(settings: GenerationSettings, target_dir: str | Path, dtype: str,
                 log: Callable[[str], None] = print) -> Backend:
    return BACKENDS[settings.backend](settings, target_dir, dtype, log)


def vllm_tokenizer(target: Path, trust_remote_code: bool) -> Any:
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # the splitter itself reports the missing vLLM clearly
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    return get_tokenizer(str(target), trust_remote_code=trust_remote_code)


# --------------------------------------------------------------------------- retries

@dataclass
class RunCounts:
    attempted: int = 0
    ok: int = 0
    failed: int = 0
    transient_failures: int = 0
    retried: int = 0
    first_transient_error: str | None = None
    # Every failed attempt, retried or final, by error_label(): what the backend went through.
    attempt_errors: Counter = field(default_factory=Counter)
    waited_s: float = 0.0


def generate_with_retries(backend: Backend, requests: Iterable[PromptRequest], retries: int,
                          on_done: Callable[[Completion], None],
                          log: Callable[[str], None] = print,
                          sleep: Callable[[float], None] = time.sleep) -> RunCounts:
    """Run every request through the backend; hand each final Completion to on_done as soon
    as it is final. See the module docstring for what is retried and what fails the job."""
    pending = list(requests)
    counts = RunCounts(attempted=len(pending))
    retry_after = 0.0
    for attempt in range(retries + 1):
        if attempt:
            # Exponential backoff, or longer where the server said so (429/503 Retry-After).
            delay = max(backend.retry_delay_s(attempt), min(retry_after, MAX_RETRY_AFTER_S))
            log(f"[retry {attempt}/{retries}] {len(pending)} prompt(s) again"
                + (f" in {delay:.1f}s" if delay else "")
                + (f" (the server asked for Retry-After {retry_after:g}s)" if retry_after else ""))
            sleep(delay)
            counts.waited_s += delay
            counts.retried += len(pending)
        again: list[PromptRequest] = []
        retry_after = 0.0
        last_attempt = attempt == retries
        for c in backend.generate(pending):
            if c.ok:
                counts.ok += 1
                on_done(c)
                continue
            counts.attempt_errors[error_label(c.error)] += 1
            retry_after = max(retry_after, c.retry_after_s or 0.0)
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
