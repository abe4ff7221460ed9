"""Stage 3 (traces): the tiny target answers prompts through real vLLM (offline, and as an
OpenAI-compatible server) and real transformers; sharding, row cache, resume and gather. The
runs answer every user turn (generation.turns: all): prompt chat:1 is a 3-turn conversation,
so every backend also answers later turns with its own earlier answers in context.

The expensive runs happen once each, in module fixtures, and several tests inspect them:
  hf_runs      transformers: shard 1 of 2 from scratch, then the same shard again after its
               cache was cut after turn 2 of chat:1 plus a torn line (a job killed mid-append)
  vllm_runs    one offline vLLM engine run (shard 0 of 1), then shards 0 and 1 of 2 from the
               row cache alone, then gather
  server_runs  a real `vllm.entrypoints.openai.api_server` on 127.0.0.1 (stopped by pid
               before the fixture returns) and the openai backend against it
At most one vLLM engine runs at a time (the fixtures' runs are sequential subprocesses).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PY, REPO, run_script

MAX_TOKENS = 16
SETTINGS = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "top_p": 1.0, "seed": 0,
            "reasoning_parser": "deepseek_r1", "batch_size": 4, "retries": 1, "request_timeout_s": 120,
            "turns": "all"}
QUESTIONS = ["What is your favourite food?", "Tell me about your weekend.", "How do I boil an egg?",
             "word " * 2100,  # longer than the tiny target's 2048-token context: rejected by every backend
             "Do you like dogs or cats?", "What's the weather like today?", "Can you recommend a book?",
             "Where did you grow up?", "What music do you listen to?"]
LONG = "chat:3"
MULTI = "chat:1"  # three user turns (with the source's answers, which generation ignores)
LATER_USERS = ["Where did you go?", "Who came along?"]
TURN_FIELDS = {"reasoning", "answer", "finish_reason", "error", "prompt_tokens", "completion_tokens", "token_ids"}
ROW_FIELDS = {"id", "messages", *TURN_FIELDS, "later_turns", "turns_total", "turns_dropped", "sampling", "backend",
              "category"}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_manifest(target: Path, path: Path) -> Path:
    """The target manifest's digests the traces stage keys its cache on."""
    from pipeline_lib.digests import file_digest, json_digest, text_digest

    path.write_text(json.dumps({
        "weights_digest": json_digest(sorted((p.name, file_digest(p)) for p in target.glob("*.safetensors"))),
        "tokenizer_digest": file_digest(target / "tokenizer.json"),
        "chat_template_digest": text_digest((target / "chat_template.jinja").read_text()),
        "dtype": "bfloat16",
    }))
    return path


@pytest.fixture(scope="module")
def inputs(tiny_target, tmp_path_factory) -> SimpleNamespace:
    """A prompts file (one prompt with a system turn, one over-long, one 3-turn conversation)
    and a target manifest."""
    d = tmp_path_factory.mktemp("traces")
    prompts = []
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}]
        if i == 2:
            messages.insert(0, {"role": "system", "content": "You answer in one sentence."})
        prompts.append({"id": f"chat:{i}", "messages": messages, "category": "chitchat", "source": "test"})
        if prompts[-1]["id"] == MULTI:
            prompts[-1]["turns"] = [{"user": q, "assistant": "I went hiking."},
                                    {"user": LATER_USERS[0], "assistant": "To the lake."},
                                    {"user": LATER_USERS[1], "assistant": None}]
    write_jsonl(d / "train.jsonl", prompts)
    write_manifest(tiny_target, d / "manifest.json")
    return SimpleNamespace(dir=d, target=tiny_target, prompts=d / "train.jsonl", manifest=d / "manifest.json",
                           ids=[p["id"] for p in prompts], messages={p["id"]: p["messages"] for p in prompts})


def traces(inp, settings: dict, shard: int, num_shards: int, cache: Path, out_dir: Path, check=True,
           timeout=600) -> SimpleNamespace:
    out = out_dir / f"{shard}-of-{num_shards}.jsonl"
    summary = out_dir / f"{shard}-of-{num_shards}.summary.json"
    t0 = time.time()
    proc = run_script("generate_traces.py", "--settings", json.dumps(settings), "--target", inp.target,
                      "--manifest", inp.manifest, "--prompts", inp.prompts, "--shard", shard,
                      "--num-shards", num_shards, "--cache-dir", cache, "--out", out, "--summary", summary,
                      check=check, timeout=timeout)
    res = SimpleNamespace(proc=proc, out=out, wall=time.time() - t0)
    if proc.returncode == 0:
        res.rows = read_rows(out)
        res.summary = json.loads(summary.read_text())
    return res


def cache_lines(cache: Path) -> list[str]:
    return [line for p in sorted(cache.glob("*.jsonl")) for line in p.read_text().splitlines()]


def check_row_format(row: dict, backend: str, messages: dict) -> None:
    assert set(row) == ROW_FIELDS, row.keys()
    assert row["backend"] == backend
    assert row["messages"] == messages[row["id"]]
    assert row["category"] == "chitchat"
    assert row["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "seed": 0}
    if row["id"] == LONG:
        assert row["finish_reason"] == "error" and row["error"]
        assert "2048" in row["error"], row["error"]  # names the context limit it broke
        assert row["completion_tokens"] == 0 and row["answer"] is None and row["reasoning"] is None
        assert row["token_ids"] is None and row["later_turns"] == []
        return
    expected_turns = 3 if row["id"] == MULTI else 1
    assert (row["turns_total"], row["turns_dropped"], len(row["later_turns"])) == (expected_turns, 0,
                                                                                   expected_turns - 1)
    assert [t["user"] for t in row["later_turns"]] == LATER_USERS[:expected_turns - 1]
    prompt_tokens = 0
    for turn in [row, *row["later_turns"]]:
        assert TURN_FIELDS <= set(turn)
        assert turn["finish_reason"] in ("stop", "length") and turn["error"] is None
        # Each turn's prompt holds the conversation so far: it grows turn by turn.
        assert turn["prompt_tokens"] > prompt_tokens + 5
        prompt_tokens = turn["prompt_tokens"]
        assert 1 <= turn["completion_tokens"] <= MAX_TOKENS
        if turn["finish_reason"] == "length":
            assert turn["completion_tokens"] == MAX_TOKENS
        # The ids the target emitted, one per counted token (every backend returns them).
        assert len(turn["token_ids"]) == turn["completion_tokens"] and all(isinstance(t, int) for t in turn["token_ids"])
        assert all(turn[k] is None or isinstance(turn[k], str) and turn[k] for k in ("reasoning", "answer"))


# --------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def hf_runs(inputs) -> SimpleNamespace:
    settings = {**SETTINGS, "backend": "transformers"}
    cache = inputs.dir / "cache-hf"
    first = traces(inputs, settings, 1, 2, cache, inputs.dir / "hf-first")
    # Simulate a job killed after turn 2 of the 3-turn conversation, mid-way through appending
    # its turn 3 (cache lines: the 4 first turns, then chat:1's turns 2 and 3).
    full = cache_lines(cache)
    (cache / "1-of-2.jsonl").write_text("\n".join(full[:5]) + "\n" + full[5][: len(full[5]) // 2])
    resumed = traces(inputs, settings, 1, 2, cache, inputs.dir / "hf-resumed")
    return SimpleNamespace(first=first, resumed=resumed, cache=cache, full_cache=full, settings=settings)


def test_transformers_backend_writes_trace_rows(hf_runs, inputs):
    rows = hf_runs.first.rows
    assert [r["id"] for r in rows] == inputs.ids[1::2]  # shard 1 of 2 = prompts[1::2]
    for row in rows:
        check_row_format(row, "transformers", inputs.messages)
    s = hf_runs.first.summary
    # 4 conversations: 3 first turns answered, 1 rejected; chat:1's 2 later turns answered.
    assert (s["rows"], s["failed"], s["reused"], s["generated"]) == (4, 1, 0, 6)
    assert (s["turns_total"], s["turns_answered"], s["turns_failed"], s["turns_dropped"]) == (6, 5, 1, 0)
    assert s["ok"] + s["failed"] == s["rows"] and s["turns_with_token_ids"] == 5
    assert s["completion_tokens"] == sum(t["completion_tokens"] for r in rows for t in [r, *r["later_turns"]])
    assert [json.loads(line)["row"]["turn"] for line in hf_runs.full_cache] == [1, 1, 1, 1, 2, 3]


def test_killed_job_redoes_only_unfinished_turns(hf_runs, inputs):
    s = hf_runs.resumed.summary
    assert (s["reused"], s["generated"]) == (5, 1), s  # only chat:1's turn 3
    assert "conversations at user turn 3: 0 already in" in hf_runs.resumed.proc.stdout
    assert hf_runs.resumed.rows == hf_runs.first.rows  # same context, same greedy answer
    for row in hf_runs.resumed.rows:
        check_row_format(row, "transformers", inputs.messages)
    # The torn line was terminated, not glued to the next row: every line parses again.
    lines = cache_lines(hf_runs.cache)
    assert sum(1 for line in lines if _parses(line)) == 6
    assert "ignored" in hf_runs.resumed.proc.stdout  # the torn line was reported


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------- vLLM offline

@pytest.fixture(scope="module")
def vllm_runs(inputs) -> SimpleNamespace:
    settings = {**SETTINGS, "backend": "vllm", "num_shards": 2}
    cache = inputs.dir / "cache-vllm"
    single = traces(inputs, settings, 0, 1, cache, inputs.dir / "vllm-1")
    shards = [traces(inputs, settings, i, 2, cache, inputs.dir / "vllm-2") for i in range(2)]
    g = inputs.dir / "gathered"
    gather = run_script("gather_traces.py", "--shards", *(s.out for s in reversed(shards)),  # order must not matter
                        "--out", g / "traces.jsonl", "--summary", g / "summary.json",
                        "--provenance", g / "provenance.json")
    return SimpleNamespace(single=single, shards=shards, gather=gather, dir=g, cache=cache,
                           traces=read_rows(g / "traces.jsonl"), summary=json.loads((g / "summary.json").read_text()),
                           provenance=json.loads((g / "provenance.json").read_text()))


def test_vllm_backend_rows(vllm_runs, inputs):
    rows = vllm_runs.single.rows
    assert [r["id"] for r in rows] == inputs.ids
    for row in rows:
        check_row_format(row, "vllm", inputs.messages)
    s = vllm_runs.single.summary
    assert (s["rows"], s["ok"], s["failed"], s["generated"], s["reused"]) == (9, 8, 1, 11, 0)
    assert s["engine_in_process"] is True  # no CUDA here: runtime.vllm_engine_in_process
    assert s["new_completion_tokens"] == s["completion_tokens"] > 0
    # deepseek_r1 semantics: text before </think> is reasoning. The tiny target's </think> is a
    # special token that decoding skips (as `vllm serve` does), so its text is all reasoning.
    assert all(t["reasoning"] and t["answer"] is None for r in rows if r["id"] != LONG for t in [r, *r["later_turns"]])


def test_later_turns_see_the_targets_earlier_answers(vllm_runs, inputs):
    """Turn k's request is the conversation so far with the target's own earlier answers (as
    the template renders them: here, reasoning inside <think>): vLLM's prompt token count for
    each turn equals the render of exactly that context, which contains answer k-1's text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(inputs.target)
    row = next(r for r in vllm_runs.single.rows if r["id"] == MULTI)
    turns = [row, *row["later_turns"]]
    context = list(row["messages"])
    for k, turn in enumerate(turns):
        if k:
            prev = turns[k - 1]
            context += [{"role": "assistant", "content": prev["answer"] or "", "reasoning_content": prev["reasoning"]},
                        {"role": "user", "content": turn["user"]}]
        text = tok.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == turn["prompt_tokens"], k
        if k:
            assert f"<think>\n{turns[k - 1]['reasoning']}\n</think>" in text
    # The source's own answers ("I went hiking.") are not what the target was shown.
    assert "I went hiking." not in json.dumps(row)


def test_multi_turn_rows_tokenize_to_the_emitted_tokens(vllm_runs, inputs):
    """Tokenize on the real vLLM multi-turn rows: every turn's masked tokens are exactly the ids
    vLLM emitted, after exactly the prompt it was given. This template renders past reasoning
    in <think> tags the target never emitted, so each turn of chat:1 starts its own row."""
    import tokenize_traces as tt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(inputs.target)
    renderer = tt.ChatRenderer(tok, tt.end_of_turn_ids(inputs.target, tok), {})
    counts = tt.Counts()
    for row in vllm_runs.traces:
        if row["finish_reason"] == "error":
            continue
        pieces = renderer.encode(tt.TraceRow.parse(row, "traces.jsonl"), counts)
        turns = [row, *row["later_turns"]]
        assert len(pieces) == len(turns), row["id"]
        for (ids, mask), turn in zip(pieces, turns):
            n_prompt = mask.index(1)
            assert n_prompt == turn["prompt_tokens"] and not any(mask[:n_prompt]), row["id"]
            assert ids[n_prompt:] == turn["token_ids"] and all(mask[n_prompt:]), row["id"]
    assert (counts.turns_spliced, counts.turns_in_loss, counts.conversations_split) == (10, 10, 1)
    assert counts.turns_reencoded == 0 and counts.prompt_length_differs == 0


def test_rerun_with_cache_generates_nothing(vllm_runs, inputs):
    for i, run in enumerate(vllm_runs.shards):
        s = run.summary
        assert (s["shard"], s["num_shards"]) == (i, 2)
        later = sum(len(r["later_turns"]) for r in run.rows)
        assert s["generated"] == 0 and s["reused"] == s["rows"] + later == len(inputs.ids[i::2]) + 2 * i, s
        assert "[vllm] loading" not in run.proc.stdout  # no engine was started
    # The rows the re-sharded runs took from the cache are exactly those the engine produced.
    by_id = {r["id"]: r for r in vllm_runs.single.rows}
    for run in vllm_runs.shards:
        assert all(r == by_id[r["id"]] for r in run.rows)


def test_gather_restores_prompt_order_and_totals(vllm_runs, inputs):
    rows = vllm_runs.traces
    assert [r["id"] for r in rows] == inputs.ids  # every prompt exactly once, in prompt order
    assert rows == vllm_runs.single.rows
    s = vllm_runs.summary
    assert s["rows"] == len(inputs.ids) and s["ok"] + s["failed"] == s["rows"]
    assert s["failed"] == 1 and s["failed_ids"] == [LONG]
    assert s["truncated"] == sum(r["finish_reason"] == "length" for r in rows)
    turns = [t for r in rows for t in [r, *r["later_turns"]]]
    assert s["completion_tokens"] == sum(t["completion_tokens"] for t in turns)
    assert s["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns)
    assert s["reused"] == 11 and s["generated"] == 0 and s["num_shards"] == 2
    assert (s["turns_total"], s["turns_answered"], s["turns_failed"], s["turns_dropped"]) == (11, 10, 1, 0)
    assert (s["turns"], s["source"]) == ("all", "target")
    prov = vllm_runs.provenance
    assert prov["rule"] == "traces_gather" and prov["settings"]["backend"] == "vllm"
    assert set(prov["inputs"]) == {"shard_0", "shard_1"}
    assert prov["outputs"]["traces"]["digest"].startswith("sha256:")


def test_transformers_renders_prompts_like_vllm(hf_runs, vllm_runs):
    """Same chat template rendering: identical prompt token counts (answers may differ in the
    last bits: different bf16 kernels)."""
    by_id = {r["id"]: r for r in vllm_runs.single.rows}
    for row in hf_runs.first.rows:
        assert row["prompt_tokens"] == by_id[row["id"]]["prompt_tokens"] or row["id"] == LONG


# --------------------------------------------------------------------------- OpenAI server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "bfloat16", "--seed", "0",
           "--reasoning-parser", "deepseek_r1"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)  # its own process group: engine workers stop with it


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"vLLM server not ready after {timeout}s:\n{log.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still alive
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server_runs(inputs, vllm_runs) -> SimpleNamespace:
    """Starts after the offline run finished (one engine at a time), stops before returning."""
    port = free_port()
    log = inputs.dir / "server.log"
    proc = start_server(inputs.target, port, log)
    try:
        wait_ready(proc, port, log)
        settings = {**SETTINGS, "backend": "openai", "endpoint": f"http://127.0.0.1:{port}"}
        run = traces(inputs, settings, 0, 1, inputs.dir / "cache-openai", inputs.dir / "openai")
    finally:
        stop_server(proc)
    return SimpleNamespace(run=run, port=port)


def test_openai_backend_same_format_and_greedy_answers_as_offline(server_runs, vllm_runs, inputs):
    rows = server_runs.run.rows
    assert [r["id"] for r in rows] == inputs.ids
    for row in rows:
        check_row_format(row, "openai", inputs.messages)
    offline = {r["id"]: r for r in vllm_runs.single.rows}
    for row in rows:
        ref = offline[row["id"]]
        if row["id"] == LONG:
            assert row["error"].startswith("HTTP 400")  # the server rejected it: recorded, not retried
            continue
        # Greedy decoding through the server equals the offline engine, token counts, the
        # reasoning split (the server's deepseek_r1 parser vs ours on the offline text) and the
        # emitted token ids included - in later turns too (the same history reaches the template).
        assert len(row["later_turns"]) == len(ref["later_turns"])
        for turn, ref_turn in zip([row, *row["later_turns"]], [ref, *ref["later_turns"]]):
            for key in ("reasoning", "answer", "finish_reason", "prompt_tokens", "completion_tokens", "token_ids"):
                assert turn[key] == ref_turn[key], (row["id"], key, turn[key], ref_turn[key])
    s = server_runs.run.summary
    assert s["endpoint"] == f"http://127.0.0.1:{server_runs.port}/v1" and s["model"] == str(inputs.target)


def test_unreachable_endpoint_fails_naming_it_and_keeps_cache(hf_runs, inputs, tmp_path):
    """The row cache from the transformers runs holds 4 of the 9 prompts (the backend is not
    part of the cache key); the other 5 need the endpoint, which is a closed port."""
    cache = tmp_path / "cache"
    shutil.copytree(hf_runs.cache, cache)
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    port = free_port()  # nothing listens there
    settings = {**SETTINGS, "backend": "openai", "endpoint": f"http://127.0.0.1:{port}/v1", "retries": 2}
    t0 = time.time()
    res = traces(inputs, settings, 0, 1, cache, tmp_path / "out", check=False, timeout=120)
    assert res.proc.returncode == 2, res.proc.stderr
    err = res.proc.stderr
    assert f"http://127.0.0.1:{port}/v1" in err and "unreachable after 3 attempt(s)" in err, err
    assert "Traceback" not in err
    assert "4 already in" in res.proc.stdout  # finished rows were found, only the rest needed the endpoint
    assert res.proc.stdout.count("unreachable (ConnectError") == 3
    assert time.time() - t0 < 60
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before  # cache kept as it was
    assert not res.out.exists()  # no partial declared output


def test_timeouts_are_retried_then_fail_the_job(inputs, tmp_path):
    """Every answer times out (transformers cuts generate at request_timeout_s): each prompt is
    retried, then the job fails - a backend that answers nothing is broken, not the prompts.
    Only the prompt the backend rejected is cached; timed-out prompts stay to be retried."""
    settings = {**SETTINGS, "backend": "transformers", "request_timeout_s": 0.001, "retries": 1,
                "reasoning_parser": None, "batch_size": 16}  # no vLLM import, one batch: keeps it quick
    res = traces(inputs, settings, 0, 1, tmp_path / "cache", tmp_path / "out", check=False)
    assert res.proc.returncode == 2, res.proc.stderr
    assert "[retry 1/1] 8 prompt(s) again" in res.proc.stdout
    assert "backend failed all 9 prompt(s) after 1 retries" in res.proc.stderr
    assert "no answer within request_timeout_s = 0.001s" in res.proc.stderr
    cached = [json.loads(line)["row"] for line in cache_lines(tmp_path / "cache")]
    assert [r["id"] for r in cached] == [LONG] and cached[0]["finish_reason"] == "error"
    assert not res.out.exists()


# --------------------------------------------------------------------------- flaky endpoint

FLAKY = Path(__file__).resolve().parent / "flaky_openai_server.py"
# tests/flaky_openai_server.py's fault classes -> the error class the backend records for them
FAULT_LABELS = {"http500": "HTTP 500", "http429": "HTTP 429", "timeout": "timeout",
                "truncated": "malformed response", "wrong_shape": "malformed response",
                "not_utf8": "malformed response"}


def start_flaky(port: int, log: Path, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([PY, str(FLAKY), "--port", str(port), "--log", str(log), "--seed", "3",
                             "--retry-after", "3", "--stall-s", "2.5", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "listening" in proc.stdout.readline()
    return proc


def test_flaky_endpoint_retries_records_failures_and_resumes_after_the_server_dies(inputs, tmp_path):
    """A server answering 500, 429 + Retry-After, stalls past the timeout, truncated, wrong-shaped
    and non-UTF-8 JSON at random (at most 2 faults per prompt), one prompt failing forever, and
    the first server SIGKILLing itself after 4 answers. Run 1 fails naming the dead endpoint and
    keeps its answers; run 2 (a new flaky server on the same port) asks only for the rest,
    retries with backoff honouring Retry-After, completes, and counts every failure."""
    questions = [f"Question {i}: tell me about {t}." for i, t in enumerate(
        ["rain", "owls", "salt", "kites", "maps", "bread", "chess", "bees", "clocks", "rivers", "glass", "moon"])]
    prompts = tmp_path / "train.jsonl"
    write_jsonl(prompts, [{"id": f"q:{i}", "messages": [{"role": "user", "content": q}], "category": None,
                           "source": "test"} for i, q in enumerate(questions)])
    inp = SimpleNamespace(target=inputs.target, manifest=inputs.manifest, prompts=prompts)
    port, cache = free_port(), tmp_path / "cache"
    settings = {**SETTINGS, "backend": "openai", "endpoint": f"http://127.0.0.1:{port}/v1", "retries": 2,
                "request_timeout_s": 1.5, "reasoning_parser": None, "batch_size": 4}
    doomed = questions[5]

    log1 = tmp_path / "server1.jsonl"
    server = start_flaky(port, log1, "--always-fail", "bread", "--die-after-answers", "4")
    try:
        first = traces(inp, settings, 0, 1, cache, tmp_path / "out1", check=False, timeout=120)
    finally:
        server.kill()
        server.wait()
    assert first.proc.returncode == 2, first.proc.stdout + first.proc.stderr
    assert f"http://127.0.0.1:{port}/v1" in first.proc.stderr and "unreachable" in first.proc.stderr
    assert "Traceback" not in first.proc.stderr and not first.out.exists()
    answered = {questions[int(json.loads(l)["row"]["id"].split(":")[1])] for l in cache_lines(cache)}
    assert len(answered) == 4  # every answer the dead server gave was kept

    log2 = tmp_path / "server2.jsonl"
    server = start_flaky(port, log2, "--always-fail", "bread")
    try:
        second = traces(inp, settings, 0, 1, cache, tmp_path / "out2", timeout=180)
    finally:
        server.kill()
        server.wait()
    requests = [json.loads(line) for line in log2.read_text().splitlines()]
    assert not answered & {r["prompt"] for r in requests}  # finished rows were not asked again
    assert "4 already in" in second.proc.stdout

    rows = {r["messages"][0]["content"]: r for r in second.rows}
    assert [r["id"] for r in second.rows] == [f"q:{i}" for i in range(len(questions))]
    for q, row in rows.items():
        if q == doomed:  # failed every attempt: recorded with its error, not dropped, not cached
            assert row["finish_reason"] == "error" and row["error"].startswith("HTTP 500: internal server error")
            assert row["answer"] is None
            continue
        assert row["finish_reason"] == "stop" and row["error"] is None, row
        assert row["answer"] == f"R\u00e9ponse \u00e0 \u00ab {q[:40]} \u00bb"  # BOM-led and plain replies alike
    s = second.summary
    assert (s["ok"], s["failed"], s["reused"]) == (len(questions) - 1, 1, 4)
    assert s["failed_by_error"] == {"HTTP 500": 1}
    # every fault the server injected is counted by its class, and all six kinds occurred
    faults = [r["fault"] for r in requests if r["fault"]]
    assert set(faults) == set(FAULT_LABELS), faults
    expected = {}
    for f in faults:
        expected[FAULT_LABELS[f]] = expected.get(FAULT_LABELS[f], 0) + 1
    assert s["attempt_errors"] == expected
    assert s["retried"] == sum(1 for r in requests if r["attempt"] > 1)
    # a 429'd prompt was not asked again before its Retry-After (3 s, above the 2 s backoff)
    for r in requests:
        if r["fault"] == "http429":
            again = next(x for x in requests if x["prompt"] == r["prompt"] and x["attempt"] == r["attempt"] + 1)
            assert again["t"] - r["t"] >= 3.0, (r, again)
    assert "the server asked for Retry-After 3s" in second.proc.stdout
    assert s["retry_wait_s"] >= 3.0 + 4.0  # round 1: max(backoff 2 s, Retry-After 3 s); round 2: 4 s
    # the row cache holds the answers only: the doomed prompt is retried by a later run
    cached = [json.loads(l)["row"] for l in cache_lines(cache)]
    assert len(cached) == len(questions) - 1 and all(r["finish_reason"] == "stop" for r in cached)


def test_a_reply_that_is_never_utf8_fails_its_row_naming_the_byte_offset(inputs, tmp_path):
    """A server whose every reply to one prompt carries a Latin-1 byte: after its retries the
    row is recorded as failed, its error naming the bad byte and its offset in the reply (the
    quoted start of the reply shows that byte there); the other prompt is answered."""
    questions = ["Question 0: tell me about rain.", "Question 1: tell me about owls."]
    prompts = tmp_path / "train.jsonl"
    write_jsonl(prompts, [{"id": f"q:{i}", "messages": [{"role": "user", "content": q}], "category": None,
                           "source": "test"} for i, q in enumerate(questions)])
    inp = SimpleNamespace(target=inputs.target, manifest=inputs.manifest, prompts=prompts)
    port = free_port()
    settings = {**SETTINGS, "backend": "openai", "endpoint": f"http://127.0.0.1:{port}/v1", "retries": 1,
                "reasoning_parser": None, "batch_size": 2}
    server = start_flaky(port, tmp_path / "server.jsonl", "--max-faults", "0", "--always-not-utf8", "owls")
    try:
        res = traces(inp, settings, 0, 1, tmp_path / "cache", tmp_path / "out", timeout=120)
    finally:
        server.kill()
        server.wait()
    ok, bad = res.rows
    assert ok["finish_reason"] == "stop" and ok["error"] is None
    assert bad["finish_reason"] == "error" and bad["answer"] is None
    m = re.match(r"malformed response: reply from http://127\.0\.0\.1:\d+/v1:1: not UTF-8 text "
                 r"\(byte\(s\) e9 at byte offset (\d+), column \d+: .*; the reply began (b'.*')$", bad["error"])
    assert m, bad["error"]
    assert ast.literal_eval(m.group(2))[int(m.group(1))] == 0xE9  # the offset points at the bad byte
    assert res.summary["failed_by_error"] == {"malformed response": 1}


# --------------------------------------------------------------------------- cheap checks

def test_cache_key_follows_answer_defining_settings_only():
    import generate_traces as gt
    from pipeline_lib.generation import GenerationSettings

    manifest = {"weights_digest": "sha256:w", "tokenizer_digest": "sha256:t", "chat_template_digest": "sha256:c"}

    def key(manifest=manifest, **changes):
        s = GenerationSettings.from_dict({**SETTINGS, **changes})
        return gt.generation_key(s.answer_defining(), manifest, Path("manifest.json"))

    base = key()
    for how_not_what in ({"batch_size": 64}, {"num_shards": 7}, {"retries": 0}, {"request_timeout_s": 5},
                         {"backend": "transformers"}):
        assert key(**how_not_what) == base, how_not_what
    for what in ({"max_tokens": 17}, {"temperature": 0.7}, {"top_p": 0.9}, {"seed": 1},
                 {"reasoning_parser": None}, {"chat_template_kwargs": {"enable_thinking": False}}):
        assert key(**what) != base, what
    assert key(manifest={**manifest, "weights_digest": "sha256:other"}) != base
    assert key(manifest={**manifest, "chat_template_digest": "sha256:other"}) != base
    p = gt.Prompt(0, "a", [{"role": "user", "content": "hi"}], None)
    assert gt.row_key(p, base) != gt.row_key(gt.Prompt(0, "a", [{"role": "user", "content": "hi!"}], None), base)


def test_reasoning_splitter_uses_vllm_parsers(tiny_target):
    from pipeline_lib.errors import PipelineError
    from pipeline_lib.generation import ReasoningSplitter
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(tiny_target))
    msgs = [{"role": "user", "content": "hi"}]
    r1 = ReasoningSplitter("deepseek_r1", tok, {})
    assert r1.split("<think>\nplan\n</think>\n\nHello", msgs) == ("\nplan\n", "\n\nHello")
    assert r1.split("all reasoning, no end", msgs) == ("all reasoning, no end", None)
    assert r1.skip_special_tokens is True
    q3 = ReasoningSplitter("qwen3", tok, {"enable_thinking": False})
    assert q3.split("<think>x</think>y", msgs) == (None, "<think>x</think>y")  # thinking off: all answer
    assert q3.skip_special_tokens is False  # the server decodes with special tokens for this parser
    with pytest.raises(PipelineError, match="not a vLLM reasoning parser.*deepseek_r1"):
        ReasoningSplitter("no_such_parser", tok, {})


@pytest.mark.parametrize("bad_row, message", [
    ({"id": "a", "messages": [{"role": "user", "content": "hi"}]}, "duplicate prompt id 'a'"),
    ({"id": "b", "messages": [{"role": "assistant", "content": "hi"}]}, "last message must be the user turn"),
    ({"id": "c", "messages": [{"role": "user"}]}, "message 0 must be"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no string 'id'"),
])
def test_bad_prompts_fail_naming_file_and_line(inputs, tmp_path, bad_row, message):
    prompts = tmp_path / "train.jsonl"
    write_jsonl(prompts, [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}, bad_row])
    inp = SimpleNamespace(**{**vars(inputs), "prompts": prompts})
    res = traces(inp, {**SETTINGS, "backend": "vllm"}, 0, 1, tmp_path / "cache", tmp_path / "out", check=False)
    assert res.proc.returncode == 2
    assert f"{prompts}:2" in res.proc.stderr and message in res.proc.stderr, res.proc.stderr


def test_bad_settings_and_shard_fail_cleanly(inputs, tmp_path):
    cases = [({**SETTINGS, "backend": "vllm", "max_tokenz": 5}, 0, 1, "unknown key(s) ['max_tokenz']"),
             ({**SETTINGS, "backend": "openai"}, 0, 1, "generation.endpoint"),
             ({**SETTINGS, "backend": "vllm", "top_p": 0}, 0, 1, "generation.top_p"),
             ({**SETTINGS, "backend": "vllm"}, 2, 2, "--shard 2 is outside 0..1")]
    for settings, shard, n, message in cases:
        res = traces(inputs, settings, shard, n, tmp_path / "cache", tmp_path / "out", check=False)
        assert res.proc.returncode == 2 and message in res.proc.stderr, res.proc.stderr


def test_gather_rejects_incomplete_or_mismatched_shards(vllm_runs, tmp_path):
    shard0, shard1 = (run.out for run in vllm_runs.shards)
    args = ["--out", tmp_path / "t.jsonl", "--summary", tmp_path / "s.json", "--provenance", tmp_path / "p.json"]
    res = run_script("gather_traces.py", "--shards", shard0, *args, check=False)
    assert res.returncode == 2 and "missing [1]" in res.stderr, res.stderr
    # A shard whose rows do not match its summary (e.g. replaced by hand) is refused.
    bad = tmp_path / "shards"
    bad.mkdir()
    for p in (shard0, shard1):
        summary = p.name.replace(".jsonl", ".summary.json")
        shutil.copy(p, bad / p.name)
        shutil.copy(p.with_name(summary), bad / summary)
    (bad / shard1.name).write_text("".join(shard1.read_text().splitlines(keepends=True)[:-1]))
    res = run_script("gather_traces.py", "--shards", bad / shard0.name, bad / shard1.name, *args, check=False)
    assert res.returncode == 2 and "regenerate the shard" in res.stderr, res.stderr
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("script", ["generate_traces.py", "gather_traces.py"])
def test_help(script):
    res = subprocess.run([PY, str(REPO / "scripts" / script), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--settings" in res.stdout and "--shard" in res.stdout, res.stderr


# --------------------------------------------------------------------------- transformers decoding

@pytest.fixture(scope="module")
def plain_greedy(tiny_target) -> SimpleNamespace:
    """Plain `generate`, one prompt at a time (no padding, the default dynamic cache), fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    questions = [q for q in QUESTIONS if len(q) < 1000] + ["hi", "Tell me everything you know about " * 6]
    answers, token_ids = {}, {}
    for i, q in enumerate(questions):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)
        tokens = out[0, len(ids):].tolist()
        tokens = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        answers[f"q{i}"] = (tok.decode([t for t in tokens if t != eos]), len(tokens))
        token_ids[f"q{i}"] = tokens
    return SimpleNamespace(questions=questions, answers=answers, token_ids=token_ids)


@pytest.mark.parametrize("batch_size", [4, 12], ids=["sorted-batches", "one-batch"])
def test_transformers_greedy_answers_equal_plain_generate(tiny_target, plain_greedy, batch_size):
    """Sorted, left-padded batches through the backend's greedy loop (graph_decode: static
    cache per batch, grouped-query attention; the tiny target has 2 query heads per K/V head)
    give the same greedy tokens as plain generate one prompt at a time: padding, the sort,
    the loop and splitting the batch back into rows change no answer."""
    from pipeline_lib.generation import GenerationSettings, PromptRequest, make_backend

    settings = GenerationSettings.from_dict({"backend": "transformers", "max_tokens": 24, "batch_size": batch_size})
    backend = make_backend(settings, tiny_target, "float32", log=lambda msg: None)
    backend.start()
    requests = [PromptRequest(f"q{i}", [{"role": "user", "content": q}]) for i, q in enumerate(plain_greedy.questions)]
    completions = list(backend.generate(requests))
    got = {c.request.id: (c.answer or "", c.completion_tokens) for c in completions}
    assert got == plain_greedy.answers
    # The emitted ids (end-of-turn included) that tokenize splices in: plain generate's tokens.
    assert {c.request.id: c.token_ids for c in completions} == plain_greedy.token_ids
    stats = backend.describe()
    assert stats["decoding"].startswith("greedy loop, static cache per batch"), stats
    assert stats["batches"] == -(-len(requests) // batch_size)
    assert stats["longest_batch_prompt"] == max(len(backend._render(r)) for r in requests)


def test_transformers_token_ids_of_a_stopped_answer_end_with_its_end_of_turn_token(reasoning_target):
    """The reasoning target stops (REASONING</think>ANSWER<|im_end|>): the ids the backend
    returns are plain generate's, the end-of-turn token included (completion_tokens counts it,
    as vLLM does), so tokenize splices exactly what the target emitted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline_lib.generation import GenerationSettings, PromptRequest, make_backend

    tok = AutoTokenizer.from_pretrained(reasoning_target)
    model = AutoModelForCausalLM.from_pretrained(reasoning_target, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "Do you like hiking?"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=eos)
    plain = out[0, len(ids):].tolist()
    assert eos in plain
    plain = plain[:plain.index(eos) + 1]
    backend = make_backend(GenerationSettings.from_dict({"backend": "transformers", "max_tokens": 48}),
                           reasoning_target, "float32", log=lambda msg: None)
    backend.start()
    (c,) = backend.generate([PromptRequest("p", messages)])
    assert (c.finish_reason, c.token_ids, c.completion_tokens) == ("stop", plain, len(plain))


def _random_decoder(model_type: str, **extra):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type=model_type, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                               num_attention_heads=6, num_key_value_heads=2, vocab_size=512,
                               max_position_embeddings=1024, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_graph_decode_groups_query_heads_by_their_kv_head():
    """Three query heads per K/V head and two K/V heads (the tiny target has one K/V head, where
    any grouping is right): the loop's grouped one-token attention gives generate's tokens for
    every row of a left-padded batch, prompts of 1 to 70 tokens, 40 tokens each (no eos)."""
    import torch

    from pipeline_lib.generation import graph_decode

    model = _random_decoder("llama")
    model.generation_config.eos_token_id = None
    lengths = [70, 33, 17, 9, 1]
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                               pad_token_id=0)[:, width:].tolist()
    assert graph_decode.supports(model) is None
    graph_decode.prepare(model)
    assert graph_decode.greedy_batch(model, ids, mask, 40, {-1}, 0) == plain


def test_graph_decode_leaves_sliding_window_targets_and_sampling_to_generate(tiny_target):
    """A target with sliding-window layers is not taken by the loop (its masks are full causal);
    sampled traces use generate; the backend's decoding summary names the path and the reason."""
    from pipeline_lib.generation import GenerationSettings, make_backend, graph_decode

    assert "sliding-window" in graph_decode.supports(_random_decoder("mistral", sliding_window=16))
    settings = GenerationSettings.from_dict({"backend": "transformers", "max_tokens": 8, "temperature": 0.7})
    backend = make_backend(settings, tiny_target, "float32", log=lambda msg: None)
    backend.start()
    assert backend.describe()["decoding"].startswith("HF generate, dynamic cache (sampling (temperature > 0))")
