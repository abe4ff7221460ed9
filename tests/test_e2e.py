"""The whole chain on the tiny reasoning target with the default (vLLM) backends, run once per
session (conftest.e2e): target -> prompts -> traces -> tokenized -> hidden states -> draft ->
load check -> report. The target reasons on purpose (scripts/make_tiny_target.py), so vLLM's
real deepseek_r1 parser splits every answer and the acceptance is measured per span."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from conftest import E2E_MIN_TAU, E2E_SECRETS, PY, SCRIPTS, run_script, run_snakemake
from make_tiny_target import ANSWER, REASONING

CHAIN = ["target/provenance.json", "prompts/train.provenance.json", "prompts/eval.provenance.json",
         "traces/provenance.json", "tokenized/provenance.json", "hidden_states/provenance.json",
         "drafts/default/provenance.json"]


def test_every_artifact_exists_with_provenance(e2e):
    r = e2e.results
    for rel in ["target/model/config.json", "target/manifest.json", "prompts/train.jsonl", "prompts/eval.jsonl",
                "traces/traces.jsonl", "tokenized/data", "tokenized/token_freq.pt", "hidden_states/manifest.json",
                "drafts/default/final/config.json", "drafts/default/untrained/config.json",
                "drafts/default/train_metrics.csv", "drafts/default/load_check.json",
                "drafts/default/report/verification.json", "drafts/default/report/report.html",
                "drafts/comparison.csv"]:
        assert (r / rel).exists(), rel
    for rel in ["target", "traces", "tokenized", "hidden_states", "drafts/default"]:
        prov = json.loads((r / rel / "provenance.json").read_text())
        assert prov["inputs"] or rel == "target"
        assert all(e["digest"].startswith("sha256:") for e in prov["outputs"].values())
        assert {"torch", "speculators", "transformers", "snakemake"} <= set(prov["packages"])


def test_cpu_jobs_run_vllms_engine_in_their_own_process(e2e):
    """Without CUDA every job that starts vLLM runs its engine in its own process (no
    EngineCore process to spawn: ~18 s less per engine start on a 2-core CPU machine), as
    runtime.vllm_engine_in_process decides; the acceptance provenance records the mode."""
    r = e2e.results
    logs = [*sorted((r / "logs/traces").glob("*.log")), *sorted((r / "logs/hidden_states").glob("*.log")),
            r / "logs/acceptance/default.log", next((r / "logs/acceptance_baseline").glob("*.log")),
            r / "logs/load_check/default.log"]
    for log in logs:
        text = log.read_text()
        assert "init engine (profile, create kv cache, warmup model) took" in text, log  # an engine ran here
        assert "(EngineCore pid=" not in text, f"{log}: vLLM's engine ran in a process of its own"
    prov = json.loads((r / "drafts/default/verify/acceptance.provenance.json").read_text())
    assert prov["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"

def test_cpu_acceptance_runs_both_drafts_in_one_engine_child(e2e):
    """On CPU one engine child measures the trained and then the untrained draft, each engine
    shut down before the next (vLLM imported once, not once per draft); both runs' figures are
    vLLM's own counters (test_verify checks them against the per-request metrics)."""
    text = (e2e.results / "logs/acceptance/default.log").read_text()
    trained = text.index("[acceptance] trained: starting vLLM")
    untrained = text.index("[acceptance] untrained: starting vLLM")
    end = text.find("[speedup]", untrained)
    pids = [set(re.findall(r"\(MainProcess pid=(\d+)\)", part)) for part in (text[trained:untrained], text[untrained:end])]
    assert len(pids[0]) == 1 and pids[0] == pids[1], pids
    assert text.count("init engine (profile, create kv cache, warmup model) took", trained, end) == 2
    acc = json.loads((e2e.results / "drafts/default/verify/acceptance.json").read_text())["acceptance"]
    assert acc["trained"]["num_drafts"] > 0 and acc["untrained"]["num_drafts"] > 0


def test_rerun_does_nothing(e2e):
    proc = run_snakemake(e2e.work, e2e.config)
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_traces_are_the_targets_reasoning_and_answer_split_by_vllms_parser(e2e):
    r = e2e.results
    prompts = [json.loads(line) for line in (r / "prompts/train.jsonl").read_text().splitlines()]
    traces = [json.loads(line) for line in (r / "traces/traces.jsonl").read_text().splitlines()]
    assert [t["id"] for t in traces] == [p["id"] for p in prompts]
    summary = json.loads((r / "traces/summary.json").read_text())
    assert summary["rows"] == len(prompts) == summary["ok"] + summary["failed"]
    assert summary["completion_tokens"] == sum(t["completion_tokens"] for t in traces)
    # Greedy decoding closes </think> after the reasoning (weights set on purpose): the real
    # deepseek_r1 parser puts what came before it in `reasoning`, the rest in `answer`.
    for t in traces:
        assert (t["reasoning"], t["answer"], t["finish_reason"]) == (REASONING, ANSWER, "stop"), t
    stats = json.loads((r / "tokenized/stats.json").read_text())
    assert stats["rows_with_reasoning"] == stats["input_rows"] == len(traces)
    assert stats["reasoning_format"] == "template"
    # generation.turns: first - the chitchat conversations' later user turns are counted as
    # dropped (in the summary and the report), not lost silently.
    later = sum(len(p.get("turns", [None])) - 1 for p in prompts)
    assert later > 0 and summary["turns"] == "first" and summary["turns_dropped"] == later
    assert summary["turns_total"] == len(prompts) + later and summary["turns_with_token_ids"] == summary["ok"]
    report = (r / "drafts/default/report/report.md").read_text()
    assert f"{summary['turns_dropped']} of {summary['turns_total']} dropped (later turns not asked)" in report


def test_hidden_states_pair_with_tokenized_rows(e2e):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    r = e2e.results
    data = load_from_disk(str(r / "hidden_states/data"))
    manifest = json.loads((r / "hidden_states/manifest.json").read_text())
    assert manifest["rows"] == len(data)
    assert manifest["aux_layer_ids"] == [2, 4, 5]  # speculators' default for 8 layers
    for i in (0, len(data) - 1):
        hs = load_file(str(r / f"hidden_states/data/hidden_states/hs_{i}.safetensors"))
        assert hs["token_ids"].tolist() == data[i]["input_ids"].tolist()
        assert tuple(hs["hidden_states"].shape) == (len(data[i]["input_ids"]), 4, 128)


def test_draft_is_trained_and_loads_in_vllm(e2e):
    r = e2e.results
    metrics = pd.read_csv(r / "drafts/default/train_metrics.csv")
    assert not metrics.empty
    final_cfg = json.loads((r / "drafts/default/final/config.json").read_text())
    assert final_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    verifier = final_cfg["speculators_config"]["verifier"]["name_or_path"]
    assert not os.path.isabs(verifier)
    assert ((r / "drafts/default/final") / verifier / "config.json").exists()
    load = json.loads((r / "drafts/default/load_check.json").read_text())
    assert load["checks"] == {"generated": True, "drafted": True, "verifier_path_resolves": True}
    assert load["ok"] is True and load["spec_decode"]["num_drafts"] > 0


def test_load_check_ok_is_false_when_a_check_fails(e2e, tmp_path):
    """`ok` means every check held: a draft whose own verifier path leads nowhere (moved
    without its target) loads and drafts, but the file says ok: false, names the check, and
    the job fails."""
    draft = tmp_path / "moved" / "final"
    shutil.copytree(e2e.results / "drafts/default/final", draft)
    out = tmp_path / "load_check.json"
    proc = run_script("load_check.py", "--target", e2e.results / "target/model", "--draft", draft, "--out", out,
                      check=False, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] is False
    assert result["checks"] == {"generated": True, "drafted": True, "verifier_path_resolves": False}
    assert "load check FAILED" in proc.stderr and "verifier path resolves to" in proc.stderr


@pytest.mark.numerics
def test_trained_draft_beats_untrained_baseline_and_the_threshold(e2e, report_figures):
    v = json.loads((e2e.results / "drafts/default/report/verification.json").read_text())
    assert v["verdict"]["passed"] is True, v["verdict"]
    assert v["contract"]["passed"] is True
    acc = v["acceptance"]["acceptance"]
    trained = acc["trained"]["mean_acceptance_length"]
    untrained = acc["untrained"]["mean_acceptance_length"]
    report_figures("e2e draft vs untrained and the report's bar", {
        "trained_tau": trained, "untrained_tau": untrained, "bar": E2E_MIN_TAU,
        "trained_rates": acc["trained"]["acceptance_rate_per_position"]})
    assert trained > untrained, (trained, untrained)
    # The test config's bar can fail: the untrained draft (same architecture, no training)
    # stays below it, and with fail_below_threshold the build would fail on it.
    [bar] = [t for t in v["thresholds"] if t["name"] == "min_mean_acceptance_length"]
    assert (bar["threshold"], bar["status"]) == (E2E_MIN_TAU, "PASS") and v["fail_below_threshold"] is True
    assert untrained < E2E_MIN_TAU <= trained


def test_untrained_baseline_runs_on_a_category_round_robin_subset(e2e):
    """verify.untrained_prompts = 4 of the 8 (one per MT-Bench category): the untrained draft's
    engine ran on the first prompt of each of the first 4 categories, the trained draft and plain
    decoding on all 8; greedy equality compares each draft with plain decoding prompt by prompt."""
    v = json.loads((e2e.results / "drafts/default/report/verification.json").read_text())
    acc = v["acceptance"]
    eval_ids = [json.loads(line)["id"] for line in (e2e.results / "prompts/eval.jsonl").read_text().splitlines()]
    # 8 eval prompts and the e2e config's 2-prompt `code` suite, measured in one job.
    assert acc["num_prompts"] == 10 and acc["settings"]["untrained_prompts"] == 4
    assert [r["id"] for r in acc["requests"]["trained"] if r["suite"] == "eval"] == eval_ids[:8]
    assert [r["id"] for r in acc["requests"]["untrained"]] == eval_ids[:4]
    assert (acc["acceptance"]["trained"]["prompts"], acc["acceptance"]["untrained"]["prompts"]) == (10, 4)
    eq = acc["greedy_equality"]
    assert (eq["trained"]["compared"], eq["untrained"]["compared"]) == (10, 4)
    assert eq["trained"]["passed"] and eq["untrained"]["passed"]
    assert sum(c["prompts"] for c in acc["per_category"]["untrained"].values()) == 4
    md = (e2e.results / "drafts/default/report/report.md").read_text()
    assert "| untrained | 4 |" in md and "| trained | 10 |" in md


def test_acceptance_is_measured_per_span_with_the_real_reasoning_split(e2e):
    v = json.loads((e2e.results / "drafts/default/report/verification.json").read_text())
    acc = v["acceptance"]
    spans = acc["spans"]
    assert spans["end_marker"] == "</think>"
    for name in ("trained", "untrained"):
        s = spans[name]
        assert s["prompts"] == {"with_end_marker": acc["acceptance"][name]["prompts"]}
        assert s["reasoning"]["num_drafts"] > 0 and s["answer"]["num_drafts"] > 0
        assert s["no_end_marker"]["num_drafts"] == 0
        assert s["reasoning"]["num_drafts"] + s["answer"]["num_drafts"] == acc["acceptance"][name]["num_drafts"]
    md = (e2e.results / "drafts/default/report/report.md").read_text()
    assert "reasoning" in md and "answer" in md


def test_no_secret_lands_in_any_file_the_run_wrote(e2e):
    """HF_TOKEN and OPENAI_API_KEY were set for the whole run: no file under the working dir
    (results, logs, benchmarks, Snakemake's .snakemake/ log and metadata) may hold either."""
    leaks = []
    for path in e2e.work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            leaks += [f"{path}: {name}" for name, value in E2E_SECRETS.items() if value.encode() in data]
    assert not leaks


def test_provenance_chain_is_checked_and_a_tampered_artifact_is_named(e2e, tmp_path):
    r = e2e.results
    v = json.loads((r / "drafts/default/report/verification.json").read_text())
    chain = v["provenance"]["chain"]
    assert chain["intact"] is True and chain["links_checked"] >= 6 and chain["disk_checked"] > 0
    # What the acceptance job measured against is in the chain too: the shared no-speculation
    # baseline and the eval suite's prompts (acceptance.json's inputs name them).
    inputs = json.loads((r / "drafts/default/verify/acceptance.json").read_text())["inputs"]
    records = {row["file"]: row for row in v["provenance"]["records"]}
    baseline = inputs["baseline"].removesuffix(".json") + ".provenance.json"
    suite = str(Path(inputs["suites"]["code"]).with_name("provenance.json"))
    assert records[baseline]["rule"] == "acceptance_baseline" and records[suite]["rule"] == "eval_suite", sorted(records)
    assert not chain["changed_on_disk"] and not chain["not_rehashed"]
    ok = subprocess.run([PY, str(SCRIPTS / "check_provenance.py"), str(r)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert " 0 mismatches" in ok.stdout

    # One byte of an upstream artifact changed after the run, in a copy of the run.
    copy = tmp_path / "results" / r.name  # recorded paths are relative to the dir above results/
    shutil.copytree(r, copy, symlinks=True)
    tampered = copy / "traces/traces.jsonl"
    data = bytearray(tampered.read_bytes())
    data[10] ^= 0x01
    tampered.write_bytes(bytes(data))

    bad = subprocess.run([PY, str(SCRIPTS / "check_provenance.py"), str(copy)], capture_output=True, text=True)
    assert bad.returncode == 1
    named = [line for line in bad.stdout.splitlines() if line.startswith("MISMATCH")]
    assert named and all("traces/traces.jsonl" in line for line in named), bad.stdout

    variant = copy / "drafts/default"
    proc = subprocess.run(
        [PY, str(SCRIPTS / "make_report.py"), "--settings", json.dumps(e2e.config["verify"]), "--variant", "default",
         "--contract", variant / "verify/contract.json", "--acceptance", variant / "verify/acceptance.json",
         "--metrics", variant / "train_metrics.csv", "--provenance", *[copy / rel for rel in CHAIN],
         "--out-dir", tmp_path / "report"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    chain = json.loads((tmp_path / "report/verification.json").read_text())["provenance"]["chain"]
    assert chain["intact"] is False and chain["links_checked"] >= 6
    assert {c["path"] for c in chain["changed_on_disk"]} == {f"results/{r.name}/traces/traces.jsonl"}
    # Named in the record of the rule that wrote it and of each rule that read it (the contract
    # checks read the traces to render each sampled conversation as vLLM would serve it).
    assert {(c["rule"], c.get("output") or c.get("input")) for c in chain["changed_on_disk"]} == \
        {("traces_gather", "traces"), ("tokenize", "traces"), ("contract_checks", "traces")}
    md = (tmp_path / "report/report.md").read_text()
    assert f"`results/{r.name}/traces/traces.jsonl` (changed" in md
    assert "provenance chain broken" in md


def test_snakemake_report_includes_verification(e2e, tmp_path):
    out = tmp_path / "report.zip"
    run_snakemake(e2e.work, e2e.config, "--report", str(out))
    import zipfile

    names = zipfile.ZipFile(out).namelist()
    assert any(n.endswith("verification.json") for n in names), names
    assert any(n.endswith("report.html") for n in names), names
