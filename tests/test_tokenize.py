"""Stage 4, tokenize: loss masks that cover exactly what the target generated, on real vLLM
generations from the tiny target, reasoning placement (template field or inlined), length
limits, the speculators data format, and the errors bad traces get.

vLLM runs once per module (tests/data/vllm_chat_traces.py) and the tokenize CLI once on its
rows; the other tests call the script's functions in-process."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PY, REPO, run_script

import tokenize_traces
from materialize_target import build_manifest
from pipeline_lib.digests import dir_manifest, text_digest
from pipeline_lib.errors import PipelineError

PROMPTS = [
    [{"role": "user", "content": "Hello! How are you doing today?"}],
    [{"role": "system", "content": "You are a friendly assistant."},
     {"role": "user", "content": "What did you do this weekend?"}],
    [{"role": "user", "content": "Do you like pizza?"}],
    [{"role": "user", "content": "I just took a nap but I still feel tired."}],
    [{"role": "user", "content": "What superpower would you want?"}],
    [{"role": "user", "content": "Tell me about your favorite movie."}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Where would you travel if you could go anywhere?"}],
]
EOT = "<|im_end|>"
# ChatML that ignores `reasoning_content` (like SmolLM2's): reasoning must be inlined.
PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def trace(i, messages, answer, reasoning=None, finish="stop", error=None, **extra):
    return {"id": f"t:{i}", "messages": messages, "reasoning": reasoning, "answer": answer,
            "finish_reason": finish, "error": error, "prompt_tokens": 0, "completion_tokens": 0,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "seed": 0},
            "backend": "vllm", "category": None, **extra}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_manifest(target: Path, path: Path) -> Path:
    path.write_text(json.dumps(build_manifest(target, "local", {"source_ref": str(target)}, False,
                                                     dir_manifest(target))))
    return path


def expected_completion(row: dict) -> str:
    if row["finish_reason"] == "length" and not row["answer"]:
        return f"<think>\n{row['reasoning']}"  # cut inside the reasoning: no closing tag was generated
    body = row["answer"] or ""
    if row["reasoning"]:
        body = f"<think>\n{row['reasoning']}\n</think>\n\n{body}"
    return body + (EOT if row["finish_reason"] == "stop" else "")


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def manifest(tiny_target, tmp_path_factory) -> Path:
    return write_manifest(tiny_target, tmp_path_factory.mktemp("manifest") / "manifest.json")


@pytest.fixture(scope="module")
def real(tiny_target, manifest, tmp_path_factory) -> dict:
    """Real vLLM generations + rows built from them, tokenized by the CLI as the rule runs it."""
    tmp = tmp_path_factory.mktemp("tokenize")
    prompts = write_jsonl(tmp / "prompts.jsonl", [{"id": f"t:{i}", "messages": m} for i, m in enumerate(PROMPTS)])
    generated = tmp / "generated.jsonl"
    proc = subprocess.run([PY, str(REPO / "tests/data/vllm_chat_traces.py"), "--target", str(tiny_target),
                           "--prompts", str(prompts), "--out", str(generated), "--max-tokens", "32"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")})
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = [json.loads(line) for line in generated.read_text().splitlines()]
    # Real generated text split into reasoning + answer (the tiny target cannot think); all of
    # it as reasoning of a row cut at max_tokens (as a reasoning parser reports a model that
    # never closed its think block); a failed row; an empty answer; a row cut before any text.
    n = len(rows)
    for k, src in enumerate(rows[:3]):
        words = src["answer"].split(" ")
        rows.append(trace(n + k, src["messages"], " ".join(words[len(words) // 2:]),
                          reasoning=" ".join(words[:len(words) // 2]) or "thinking", finish=src["finish_reason"]))
    cut = next(r for r in rows if r["finish_reason"] == "length")
    rows.append(trace(n + 3, cut["messages"], None, reasoning=cut["answer"], finish="length"))
    rows.append(trace(n + 4, PROMPTS[0], None, finish="error", error="request timed out"))
    rows.append(trace(n + 5, PROMPTS[2], ""))
    rows.append(trace(n + 6, PROMPTS[3], "", finish="length"))
    traces = write_jsonl(tmp / "traces.jsonl", rows)
    out = tmp / "tokenized"
    run_script("tokenize_traces.py", "--settings", json.dumps({"max_seq_len": 256, "overlength": "truncate",
                                                               "drop_failed": True}),
               "--target", tiny_target, "--manifest", manifest, "--traces", traces,
               "--out-data", out / "data", "--token-freq", out / "token_freq.pt", "--stats", out / "stats.json",
               "--provenance", out / "provenance.json")
    from datasets import load_from_disk

    return {"rows": rows, "out": out, "ds": load_from_disk(str(out / "data")),
            "stats": json.loads((out / "stats.json").read_text())}


def kept(real) -> list[tuple[dict, dict]]:
    by_id = {r["id"]: r for r in real["rows"]}
    return [(by_id[rid], item) for rid, item in zip(real["stats"]["row_ids"], real["ds"])]


# --------------------------------------------------------------------------------------
# Masks on real generations
# --------------------------------------------------------------------------------------

def test_real_generations_cover_both_finish_reasons(real):
    reasons = {r["finish_reason"] for r in real["rows"] if "prompt_token_ids" in r}
    assert reasons == {"stop", "length"}, reasons


def test_prompt_part_is_exactly_what_vllm_fed_the_target(real):
    for row, item in kept(real):
        if "prompt_token_ids" not in row:
            continue
        n_prompt = int((item["loss_mask"] == 0).sum())
        assert item["input_ids"][:n_prompt].tolist() == row["prompt_token_ids"], row["id"]


def test_mask_covers_exactly_the_assistant_text(real, tokenizer):
    for row, item in kept(real):
        ids, mask = item["input_ids"], item["loss_mask"]
        n_prompt = int((mask == 0).sum())
        assert mask[:n_prompt].sum() == 0 and bool(mask[n_prompt:].all()), row["id"]  # one contiguous span
        prompt_text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(ids[:n_prompt]) == prompt_text, row["id"]
        assert tokenizer.decode(ids[n_prompt:]) == expected_completion(row), row["id"]
        eot = tokenizer.convert_tokens_to_ids(EOT)
        assert (ids[-1].item() == eot) == (row["finish_reason"] == "stop"), row["id"]


def test_mask_is_exactly_the_emitted_token_ids(real, tokenizer):
    """Rows with the target's token ids get exactly those ids in the loss, also where the random
    target sampled a split of its text that re-encoding would not reproduce."""
    spliced = [(row, item) for row, item in kept(real) if row.get("token_ids") is not None]
    assert len(spliced) == 8 == real["stats"]["turns_spliced"]
    noncanonical = 0
    for row, item in spliced:
        assert item["input_ids"][item["loss_mask"] == 1].tolist() == row["token_ids"], row["id"]
        body = row["token_ids"][:-1] if row["finish_reason"] == "stop" else row["token_ids"]
        noncanonical += tokenizer(row["answer"], add_special_tokens=False)["input_ids"] != body
    assert real["stats"]["reencode_differs"] == noncanonical
    # The planted rows without ids (the one cut before any text is re-encoded, then dropped as empty).
    assert real["stats"]["turns_reencoded"] == len(kept(real)) - len(spliced) + real["stats"]["dropped_empty"]
    assert real["stats"]["prompt_length_differs"] == 0  # tokenize renders the prompts vLLM saw


def test_token_ids_are_spliced_where_re_encoding_differs(tokenizer):
    """A planted answer whose ids are its characters one by one: re-encoding the text gives
    other (merged) tokens; the row keeps the emitted ones and the stats count the difference."""
    renderer = renderer_with(tokenizer)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    text = "Fine, thanks."
    canonical = tokenizer(text, add_special_tokens=False)["input_ids"]
    by_char = [i for c in text for i in tokenizer(c, add_special_tokens=False)["input_ids"]]
    assert by_char != canonical and tokenizer.decode(by_char) == text
    for ids, differs in ((by_char, 1), (canonical, 0)):
        counts = tokenize_traces.Counts()
        row = trace(0, PROMPTS[0], text, token_ids=ids + [eot])
        [(input_ids, mask)] = renderer.encode(tokenize_traces.TraceRow.parse(row, "traces.jsonl:1"), counts)
        assert [t for t, m in zip(input_ids, mask) if m] == ids + [eot]
        assert (counts.turns_spliced, counts.turns_reencoded, counts.reencode_differs) == (1, 0, differs)
    # Without ids the text is re-encoded (the prompt set's own answers): canonical tokens.
    counts = tokenize_traces.Counts()
    [(input_ids, mask)] = renderer.encode(tokenize_traces.TraceRow.parse(trace(0, PROMPTS[0], text), "t:1"), counts)
    assert [t for t, m in zip(input_ids, mask) if m] == canonical + [eot]
    assert (counts.turns_spliced, counts.turns_reencoded, counts.roundtrip_differs) == (0, 1, 0)


def test_reasoning_goes_through_the_template_field(real, tokenizer):
    assert real["stats"]["reasoning_format"] == "template"
    with_reasoning = [(r, it) for r, it in kept(real) if r["reasoning"]]
    assert len(with_reasoning) == 4 == real["stats"]["rows_with_reasoning"]
    for row, item in with_reasoning:
        masked = tokenizer.decode(item["input_ids"][item["loss_mask"] == 1])
        if row["answer"]:
            assert masked.startswith("<think>\n" + row["reasoning"] + "\n</think>\n\n"), row["id"]
        else:  # cut inside its reasoning: ends with the target's last text, no closing tag
            assert masked == "<think>\n" + row["reasoning"] and "</think>" not in masked, row["id"]


# --------------------------------------------------------------------------------------
# Output format and stats
# --------------------------------------------------------------------------------------

def test_speculators_data_format(real):
    from datasets import Value

    ds = real["ds"]
    assert ds.format["type"] == "torch"
    assert ds.features["input_ids"].feature == Value("int64") and ds.features["loss_mask"].feature == Value("int64")
    assert ds.features["seq_len"] == Value("int64")
    for item in ds:
        assert item["input_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.int64
        assert item["seq_len"].item() == len(item["input_ids"]) == len(item["loss_mask"])
        assert set(item["loss_mask"].unique().tolist()) <= {0, 1}


def test_stats_and_token_freq(real):
    stats, rows = real["stats"], real["rows"]
    assert stats["input_rows"] == len(rows) and stats["dropped_failed"] == 1 and stats["dropped_empty"] == 1
    assert stats["rows"] == len(rows) - 2 == len(real["ds"])
    failed = [r["id"] for r in rows if r["finish_reason"] == "error"]
    empty = [r["id"] for r in rows if r["finish_reason"] == "length" and not r["answer"] and not r["reasoning"]]
    assert stats["row_ids"] == [r["id"] for r in rows if r["id"] not in failed + empty]  # trace order kept
    assert stats["dropped_ids"]["failed"] == failed and stats["dropped_ids"]["empty"] == empty
    freq = torch.load(real["out"] / "token_freq.pt", weights_only=True)
    expected: dict[int, int] = {}
    for item in real["ds"]:
        for t in item["input_ids"][item["loss_mask"] == 1].tolist():
            expected[t] = expected.get(t, 0) + 1
    assert freq == expected and sum(freq.values()) == stats["loss_tokens"]
    assert stats["tokens"] == sum(len(it["input_ids"]) for it in real["ds"])
    manifest = json.loads(Path(real["out"] / "provenance.json").read_text())["inputs"]
    assert set(manifest) == {"target", "manifest", "traces"}


# --------------------------------------------------------------------------------------
# In-process: placement fallback, lengths, bad input
# --------------------------------------------------------------------------------------

def renderer_with(tokenizer, template: str | None = None):
    tok = tokenizer
    if template is not None:
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = template
    return tokenize_traces.ChatRenderer(tok, {tok.convert_tokens_to_ids(EOT)}, {})


def encode(renderer, row) -> tuple[list[int], list[int]]:
    [piece] = renderer.encode(tokenize_traces.TraceRow.parse(row, "traces.jsonl:1"))  # one turn: one row
    return piece


def test_inline_reasoning_when_template_ignores_the_field(tokenizer):
    renderer = renderer_with(tokenizer, PLAIN_CHATML)
    assert renderer.reasoning_format == "inline"
    row = trace(0, PROMPTS[1], "Hiking.", reasoning="The user asks about my weekend.")
    ids, mask = encode(renderer, row)
    masked = [t for t, m in zip(ids, mask) if m]
    assert tokenizer.decode(masked) == "<think>\nThe user asks about my weekend.\n</think>\n\nHiking.<|im_end|>"
    assert tokenizer.decode([t for t, m in zip(ids, mask) if not m]).endswith("<|im_start|>assistant\n")


def test_suffix_after_end_of_turn_is_not_trained(tokenizer):
    renderer = renderer_with(tokenizer)
    ids, mask = encode(renderer, trace(0, PROMPTS[0], "Fine."))
    full = tokenizer.apply_chat_template(PROMPTS[0] + [{"role": "assistant", "content": "Fine."}], tokenize=False)
    assert full.endswith("<|im_end|>\n")  # the template's trailing newline ...
    assert tokenizer.decode(ids).endswith("Fine.<|im_end|>")  # ... is not part of the row


def test_prompt_not_a_prefix_names_the_row(tokenizer):
    # The generation prompt opens a think block that the rendered answer does not have.
    template = PLAIN_CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    with pytest.raises(PipelineError, match=r"traces\.jsonl:1: row t:0: .*not a token prefix"):
        encode(renderer_with(tokenizer, template), trace(0, PROMPTS[0], "Fine."))


def test_template_without_end_of_turn_is_refused(tokenizer):
    template = PLAIN_CHATML.replace("'<|im_end|>\\n'", "'\\n'")
    with pytest.raises(PipelineError, match=r"row t:0: the chat template puts no end-of-turn token"):
        encode(renderer_with(tokenizer, template), trace(0, PROMPTS[0], "Fine."))


@pytest.fixture
def long_traces(tmp_path) -> Path:
    return write_jsonl(tmp_path / "traces.jsonl", [
        trace(0, PROMPTS[0], "short answer"),
        trace(1, PROMPTS[0], "a much longer answer " * 30),
        trace(2, [{"role": "user", "content": "a very long prompt " * 40}], "ok"),
        trace(3, PROMPTS[0], None, finish="error", error="boom"),
    ])


@pytest.mark.parametrize("overlength, kept_ids, truncated, dropped", [
    ("truncate", ["t:0", "t:1"], 1, 1),  # t:2's prompt alone fills max_seq_len: nothing to learn
    ("drop", ["t:0"], 0, 2),
])
def test_overlength(tokenizer, long_traces, overlength, kept_ids, truncated, dropped):
    counts = tokenize_traces.Counts()
    settings = {"max_seq_len": 64, "overlength": overlength, "drop_failed": True}
    out = list(tokenize_traces.tokenize_traces(long_traces, renderer_with(tokenizer), settings, counts))
    assert [rid for rid, _, _ in out] == kept_ids
    assert all(len(ids) <= 64 and len(ids) == len(mask) for _, ids, mask in out)
    assert (counts.truncated, counts.dropped_overlength, counts.dropped_failed) == (truncated, dropped, 1)


def test_failed_row_is_an_error_unless_dropped(tokenizer, long_traces):
    settings = {"max_seq_len": 1024, "drop_failed": False}
    with pytest.raises(PipelineError, match=r"traces\.jsonl:4: row t:3: generation failed \(boom\)"):
        list(tokenize_traces.tokenize_traces(long_traces, renderer_with(tokenizer), settings,
                                             tokenize_traces.Counts()))


def test_malformed_trace_line(tokenizer, tmp_path):
    bad = tmp_path / "traces.jsonl"
    bad.write_text(json.dumps(trace(0, PROMPTS[0], "ok")) + "\n{oops\n")
    with pytest.raises(PipelineError, match=rf"{bad}:2: not valid JSON"):
        list(tokenize_traces.tokenize_traces(bad, renderer_with(tokenizer), {}, tokenize_traces.Counts()))
    bad.write_text(json.dumps({"id": "x", "messages": PROMPTS[0]}) + "\n")
    with pytest.raises(PipelineError, match=r"traces\.jsonl:1: trace row lacks finish_reason"):
        list(tokenize_traces.tokenize_traces(bad, renderer_with(tokenizer), {}, tokenize_traces.Counts()))


def run_main_in_process(monkeypatch, target: Path, manifest: Path, traces: Path, out: Path) -> None:
    """main() as the rule calls it, in this process (no second transformers start-up)."""
    monkeypatch.setattr(sys, "argv", ["tokenize_traces.py", "--settings", json.dumps({"max_seq_len": 128}),
                                      "--target", str(target), "--manifest", str(manifest), "--traces", str(traces),
                                      "--out-data", str(out / "data"), "--token-freq", str(out / "token_freq.pt"),
                                      "--stats", str(out / "stats.json"), "--provenance", str(out / "provenance.json")])
    tokenize_traces.main()


def test_no_usable_row_is_an_error_and_writes_nothing(tiny_target, manifest, tmp_path, monkeypatch):
    traces = write_jsonl(tmp_path / "traces.jsonl", [trace(0, PROMPTS[0], None, finish="error", error="x")])
    out = tmp_path / "tok"
    with pytest.raises(PipelineError, match=rf"^{traces}: no usable row \(1 rows, 1 failed"):
        run_main_in_process(monkeypatch, tiny_target, manifest, traces, out)
    assert not out.exists() or not any(out.iterdir())


def test_tokenizer_files_changed_after_target_stage(tiny_target, manifest, tmp_path, monkeypatch):
    edited = tmp_path / "target"
    shutil.copytree(tiny_target, edited)
    cfg = json.loads((edited / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 123456
    (edited / "tokenizer_config.json").write_text(json.dumps(cfg))
    traces = write_jsonl(tmp_path / "traces.jsonl", [trace(0, PROMPTS[0], "ok")])
    with pytest.raises(PipelineError, match="tokenizer files differ from the ones in"):
        run_main_in_process(monkeypatch, edited, manifest, traces, tmp_path / "tok")


def test_stats_record_the_digests_of_what_was_loaded(real, tiny_target):
    """The contract checks compare these with the target manifest: they must be measured here
    from the files the tokenizer loaded, not copied from the manifest."""
    from pipeline_lib.target import tokenizer_digest

    stats = real["stats"]
    assert stats["tokenizer_digest"] == tokenizer_digest(tiny_target)
    assert stats["chat_template_digest"] == text_digest((tiny_target / "chat_template.jinja").read_text())


def test_chat_template_changed_after_target_stage(tiny_target, manifest, tmp_path, monkeypatch):
    edited = tmp_path / "target"
    shutil.copytree(tiny_target, edited)
    (edited / "chat_template.jinja").write_text(PLAIN_CHATML)
    traces = write_jsonl(tmp_path / "traces.jsonl", [trace(0, PROMPTS[0], "ok")])
    with pytest.raises(PipelineError, match="chat template differs from the one in"):
        run_main_in_process(monkeypatch, edited, manifest, traces, tmp_path / "tok")
