#!/usr/bin/env python
"""A flaky OpenAI-compatible chat server on 127.0.0.1, for the openai backend's fault tests.

    python tests/flaky_openai_server.py --port P --log requests.jsonl [--seed 0] [--max-faults 2]
        [--always-fail TEXT ...] [--always-not-utf8 TEXT ...] [--retry-after 3] [--stall-s 2.5] [--die-after-answers N]

Each prompt (keyed by its last user message) meets a seeded random number of faults, at most
--max-faults, on its first attempts, then gets an answer: bounded loops, so a client that
retries enough always gets through. Prompts containing an --always-fail text get HTTP 500 on
every attempt; prompts containing an --always-not-utf8 text get the not_utf8 fault on every
attempt. The faults:

  http500      HTTP 500 with an OpenAI error object
  http429      HTTP 429 with `Retry-After: <--retry-after>`
  timeout      no reply for --stall-s seconds (longer than the client's request_timeout_s)
  truncated    a 200 whose JSON body stops half-way
  wrong_shape  a 200 with valid JSON of the wrong shape (no choices, message not an object,
               content not text, usage not counts)
  not_utf8     a 200 whose body has a Latin-1 byte in the answer

Every third answer starts with a UTF-8 byte-order mark (valid JSON to a tolerant client).
Each request is logged as one JSON line {"prompt", "attempt", "fault", "t"} (fault null for an
answer), flushed at once. With --die-after-answers N the server SIGKILLs itself right after
its N-th answer: the endpoint dies mid-run, as a crashed server does.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("http500", "http429", "timeout", "truncated", "wrong_shape", "not_utf8")
WRONG_SHAPES = (
    {"object": "chat.completion", "choices": []},
    {"choices": [{"index": 0, "message": "just a string", "finish_reason": "stop"}]},
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": 42}, "finish_reason": "stop"}]},
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
     "usage": {"prompt_tokens": "many"}},
)


def answer_text(prompt: str) -> str:
    """The answer a prompt always gets (non-ASCII on purpose)."""
    return f"Réponse à « {prompt[:40]} »"


def fault_plan(prompt: str, seed: int, max_faults: int) -> list[str]:
    rng = random.Random(f"{seed}:{prompt}")
    return [rng.choice(FAULTS) for _ in range(rng.randint(0, max_faults))]


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.attempts: dict[str, int] = {}
        self.answers = 0
        self.log = open(args.log, "a", encoding="utf-8")

    def next_attempt(self, prompt: str) -> tuple[int, str | None]:
        with self.lock:
            n = self.attempts.get(prompt, 0) + 1
            self.attempts[prompt] = n
        if any(text in prompt for text in self.args.always_fail):
            return n, "http500"
        if any(text in prompt for text in self.args.always_not_utf8):
            return n, "not_utf8"
        plan = fault_plan(prompt, self.args.seed, self.args.max_faults)
        return n, plan[n - 1] if n <= len(plan) else None

    def record(self, prompt: str, attempt: int, fault: str | None) -> None:
        with self.lock:
            self.log.write(json.dumps({"prompt": prompt, "attempt": attempt, "fault": fault,
                                       "t": time.time()}) + "\n")
            self.log.flush()


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep the test output quiet
            pass

        def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            try:
                self.wfile.write(body)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout fault)
                pass

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": "flaky-target"}]}).encode())
            else:
                self._send(404, b'{"error": {"message": "not found"}}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            prompt = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
            attempt, fault = state.next_attempt(prompt)
            state.record(prompt, attempt, fault)
            if fault == "http500":
                return self._send(500, b'{"error": {"message": "internal server error", "type": "server_error"}}')
            if fault == "http429":
                return self._send(429, b'{"error": {"message": "rate limited"}}',
                                  {"Retry-After": str(state.args.retry_after)})
            if fault == "timeout":
                time.sleep(state.args.stall_s)
            answer = answer_text(prompt)
            reply = {"id": f"chatcmpl-{attempt}", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(answer.split()),
                               "total_tokens": len(prompt.split()) + len(answer.split())}}
            data = json.dumps(reply, ensure_ascii=False).encode()
            if fault == "truncated":
                return self._send(200, data[: len(data) // 2])
            if fault == "wrong_shape":
                shape = WRONG_SHAPES[attempt % len(WRONG_SHAPES)]
                return self._send(200, json.dumps(shape).encode())
            if fault == "not_utf8":
                return self._send(200, data.replace("é".encode(), b"\xe9", 1))
            with state.lock:
                state.answers += 1
                n = state.answers
            self._send(200, (b"\xef\xbb\xbf" if n % 3 == 0 else b"") + data)
            if state.args.die_after_answers and n >= state.args.die_after_answers:
                os.kill(os.getpid(), signal.SIGKILL)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-faults", type=int, default=2)
    p.add_argument("--always-fail", nargs="*", default=[])
    p.add_argument("--always-not-utf8", nargs="*", default=[])
    p.add_argument("--retry-after", type=int, default=3)
    p.add_argument("--stall-s", type=float, default=2.5)
    p.add_argument("--die-after-answers", type=int, default=0)
    args = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(State(args)))
    server.daemon_threads = True
    print(f"listening on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
