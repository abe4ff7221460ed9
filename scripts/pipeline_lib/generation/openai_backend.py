"""openai backend: chat completions against an OpenAI-compatible endpoint (`vllm serve`, SGLang, ...)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from email.utils import parsedate_to_datetime
from typing import Any, Iterator

from .base import (ERROR_INVALID, ERROR_TRANSIENT, ERROR_UNREACHABLE, MAX_RETRY_AFTER_S, Backend,
                   BackendUnavailable, Completion, PromptRequest, none_if_empty, redact_url, register,
                   vllm_tokenizer)
from ..errors import PipelineError
from ..io import decode_text
from ..secrets import scrub

# Statuses that say "later", not "never": retried (with the server's Retry-After, if any).
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)


@register("openai")
class OpenAIBackend(Backend):
    """Chat completions against an OpenAI-compatible endpoint, batch_size requests at a time.
    The API key, if the server wants one, comes from $OPENAI_API_KEY (never from settings,
    so it never lands in configs, logs or provenance)."""

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
        # vLLM's extension: the answer's token ids (spliced into the training rows as emitted).
        self.ask_token_ids = True

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
        wait = 0.0
        for attempt in range(attempts):
            if attempt:
                time.sleep(max(self.retry_delay_s(attempt), min(wait, MAX_RETRY_AFTER_S)))
            try:
                r = self.client.get("/models", timeout=min(30.0, s.request_timeout_s))
            except httpx.TransportError as err:
                last = f"{type(err).__name__}: {err}"
                self.log(f"[openai] attempt {attempt + 1}/{attempts}: {self.shown_url} unreachable ({last})")
                continue
            if r.status_code in RETRY_STATUSES:
                last, wait = f"HTTP {r.status_code}", retry_after_s(r) or 0.0
                continue
            self._raise_for_fatal_status(r, "GET /models")
            if r.status_code == 404 and s.model_name:  # some servers have no /models
                return s.model_name
            if r.status_code != 200:
                raise BackendUnavailable(f"{self.shown_url}/models answered HTTP {r.status_code}: "
                                         f"{scrub(r.text[:300])}; is generation.endpoint an OpenAI-compatible API?")
            try:
                served = [m.get("id") for m in parse_json_reply(r.content, f"{self.shown_url}/models")["data"]]
            except (ValueError, KeyError, TypeError, AttributeError, PipelineError) as err:
                raise BackendUnavailable(f"{self.shown_url}/models answered something that is not a model list "
                                         f"({err}); is generation.endpoint an OpenAI-compatible API?") from None
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
        if any(req.prompt_token_ids is not None for req in requests):
            raise PipelineError("the openai backend sends chat messages only; raw token-id prompts (the "
                                "synthesize stage) need the vllm or transformers backend")
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
        if self.ask_token_ids:
            body["return_token_ids"] = True
        try:
            r = self.client.post("/chat/completions", json=body)
        except httpx.ConnectTimeout as err:
            return Completion.failed(req, f"unreachable: {self.shown_url} ({err})", ERROR_UNREACHABLE)
        except httpx.TimeoutException:
            return Completion.failed(req, f"timeout: no answer within request_timeout_s = {s.request_timeout_s}s",
                                     ERROR_TRANSIENT)
        except httpx.ConnectError as err:
            return Completion.failed(req, f"unreachable: {self.shown_url} ({err})", ERROR_UNREACHABLE)
        except httpx.TransportError as err:
            return Completion.failed(req, f"connection: {type(err).__name__}: {err}", ERROR_TRANSIENT)
        self._raise_for_fatal_status(r, "POST /chat/completions")
        if r.status_code == 400 and self.ask_token_ids and "return_token_ids" in r.text:
            self.log(f"[openai] {self.shown_url} does not return token ids; answers will be re-encoded")
            self.ask_token_ids = False
            return self._chat(req)
        if r.status_code != 200:
            kind = ERROR_TRANSIENT if r.status_code in RETRY_STATUSES or r.status_code >= 500 else ERROR_INVALID
            return Completion.failed(req, f"HTTP {r.status_code}: {_error_text(r)}", kind,
                                     retry_after_s=retry_after_s(r))
        try:
            reply = parse_chat_reply(r.content, f"reply from {self.shown_url}")
        except (ValueError, PipelineError) as err:
            # Truncated or wrong-shaped replies come from overloaded or buggy servers: retry.
            return Completion.failed(req, f"malformed response: {err}; the reply began {r.content[:200]!r}",
                                     ERROR_TRANSIENT)
        message, finish, usage, token_ids = reply
        prompt_tokens = usage.get("prompt_tokens", 0)
        finish = {"tool_calls": "stop", "function_call": "stop"}.get(finish, finish)
        if finish not in ("stop", "length"):
            return Completion.failed(req, f"finish_reason {finish!r}: the server did not finish the answer",
                                     ERROR_TRANSIENT, prompt_tokens)
        reasoning, answer = self._server_split(message, req.messages)
        return Completion(req, reasoning, answer, finish, prompt_tokens, usage.get("completion_tokens", 0),
                          token_ids=token_ids)

    def _server_split(self, message: dict[str, Any], messages: list[dict[str, Any]]):
        content = message.get("content") or ""
        server_reasoning = message.get("reasoning") or message.get("reasoning_content")
        if server_reasoning is not None or not self.settings.reasoning_parser:
            # The server ran a reasoning parser (vLLM: `reasoning`; older servers:
            # `reasoning_content`), or no split is wanted.
            return none_if_empty(server_reasoning), none_if_empty(content)
        # The server ran no parser. Split locally only when the reasoning markup is visibly
        # in the text: re-parsing an already-split answer would turn it into reasoning.
        if self.splitter is None:
            self._make_splitter(vllm_tokenizer(self.target, self.settings.trust_remote_code))
        if any(m in content for m in self.splitter.markers):
            return self.splitter.split(content, messages)
        return None, none_if_empty(content)


def retry_after_s(r: Any) -> float | None:
    """Seconds from a Retry-After header (delay-seconds or an HTTP date), None without one."""
    value = r.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def parse_json_reply(body: bytes, where: str) -> Any:
    """A reply body as JSON: strict UTF-8 (a byte-order mark is skipped; bad bytes are named by
    offset); a truncated body names the byte where it broke off."""
    text = decode_text(body, where)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not complete JSON ({err.msg} at character {err.pos} of {len(text)})") from None


def parse_chat_reply(body: bytes, where: str) -> tuple[dict[str, Any], Any, dict[str, int], list[int] | None]:
    """(message, finish_reason, usage, token_ids) of a chat-completions reply, its shape checked:
    a reply of the wrong shape is an error here, never a row with a non-text answer. token_ids
    (vLLM's `return_token_ids` extension) is None when the server sent none."""
    data = parse_json_reply(body, where)
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"no choices[0] object (got {type(data).__name__} with keys "
                         f"{sorted(data)[:8] if isinstance(data, dict) else '-'})")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ValueError(f"choices[0].message is {type(message).__name__}, not an object")
    for key in ("content", "reasoning", "reasoning_content"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise ValueError(f"choices[0].message.{key} is {type(message[key]).__name__}, not text")
    usage = data.get("usage") or {}
    if not isinstance(usage, dict):
        raise ValueError(f"usage is {type(usage).__name__}, not an object")
    counts = {}
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key) or 0
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"usage.{key} = {value!r} is not a token count")
        counts[key] = value
    token_ids = choices[0].get("token_ids")
    if token_ids is not None and (not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids)):
        raise ValueError(f"choices[0].token_ids is not a list of token ids ({str(token_ids)[:80]})")
    return message, choices[0].get("finish_reason"), counts, token_ids or None


def _api_base(endpoint: str) -> str:
    """Accepts http://host:port or http://host:port/v1 (with or without a trailing slash)."""
    url = endpoint.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise PipelineError(f"setting generation.endpoint = {redact_url(endpoint)!r} is not an http(s) URL; "
                            f"use e.g. http://127.0.0.1:8000/v1")
    return url if url.endswith("/v1") else url + "/v1"


def _error_text(r: Any) -> str:
    try:
        err = parse_json_reply(r.content, "error reply")
    except (ValueError, PipelineError):
        return scrub(r.text[:1000])
    msg = err.get("error", err) if isinstance(err, dict) else err
    msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    return scrub(str(msg))[:1000]


