"""The whole chain on the tiny target with the default (vLLM) backends, run once per session
(the `e2e` fixture in conftest.py, shared with test_faults.py):
target -> prompts -> traces -> tokenized -> hidden states -> draft -> load check -> report."""
from __future__ import annotations

import json
import os
import subprocess

import pandas as pd

from conftest import E2E_FAKE_TOKEN as FAKE_TOKEN, PY, SCRIPTS, run_snakemake


def test_every_artifact_exists_with_provenance(e2e):
    _, r, _ = e2e
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


def test_rerun_does_nothing(e2e):
    work, _, cfg = e2e
    proc = run_snakemake(work, cfg)
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_traces_cover_every_prompt_and_count_consistently(e2e):
    _, r, cfg = e2e
    prompts = [json.loads(l) for l in (r / "prompts/train.jsonl").read_text().splitlines()]
    traces = [json.loads(l) for l in (r / "traces/traces.jsonl").read_text().splitlines()]
    assert [t["id"] for t in traces] == [p["id"] for p in prompts]
    summary = json.loads((r / "traces/summary.json").read_text())
    assert summary["rows"] == len(prompts) == summary["ok"] + summary["failed"]
    assert summary["completion_tokens"] == sum(t["completion_tokens"] for t in traces)
    # The tiny target's random weights never emit </think>: with the deepseek_r1 parser all
    # generated text is reasoning, and it is kept (not dropped as "no answer").
    assert all(t["reasoning"] for t in traces if t["finish_reason"] != "error")


def test_hidden_states_pair_with_tokenized_rows(e2e):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    _, r, _ = e2e
    data = load_from_disk(str(r / "hidden_states/data"))
    manifest = json.loads((r / "hidden_states/manifest.json").read_text())
    assert manifest["rows"] == len(data)
    assert manifest["aux_layer_ids"] == [2, 4, 5]  # speculators' default for 8 layers
    for i in (0, len(data) - 1):
        hs = load_file(str(r / f"hidden_states/data/hidden_states/hs_{i}.safetensors"))
        assert hs["token_ids"].tolist() == data[i]["input_ids"].tolist()
        assert tuple(hs["hidden_states"].shape) == (len(data[i]["input_ids"]), 4, 128)


def test_draft_is_trained_and_loads_in_vllm(e2e):
    _, r, _ = e2e
    metrics = pd.read_csv(r / "drafts/default/train_metrics.csv")
    assert not metrics.empty
    final_cfg = json.loads((r / "drafts/default/final/config.json").read_text())
    assert final_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    verifier = final_cfg["speculators_config"]["verifier"]["name_or_path"]
    assert not os.path.isabs(verifier)
    assert ((r / "drafts/default/final") / verifier / "config.json").exists()
    assert json.loads((r / "drafts/default/load_check.json").read_text())["ok"] is True


def test_trained_draft_beats_untrained_baseline(e2e):
    _, r, _ = e2e
    v = json.loads((r / "drafts/default/report/verification.json").read_text())
    assert v["verdict"]["passed"] is True, v["verdict"]
    assert v["contract"]["passed"] is True
    acc = v["acceptance"]["acceptance"]
    trained = acc["trained"]["mean_acceptance_length"]
    untrained = acc["untrained"]["mean_acceptance_length"]
    assert trained > untrained, (trained, untrained)


def test_no_secret_lands_in_logs_provenance_or_reports(e2e):
    work, _, _ = e2e
    leaks = []
    for path in list(work.rglob("*.json")) + list(work.rglob("*.log")) + list(work.rglob("*.md")) \
            + list(work.rglob("*.html")) + list(work.rglob("*.csv")):
        if path.is_file() and FAKE_TOKEN in path.read_text(errors="ignore"):
            leaks.append(str(path))
    assert not leaks


def test_provenance_check_passes_then_names_a_tampered_artifact(e2e, tmp_path):
    _, r, _ = e2e
    ok = subprocess.run([PY, str(SCRIPTS / "check_provenance.py"), str(r)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert " 0 mismatches" in ok.stdout
    # Tamper with a copy, not the shared run.
    import shutil

    copy = tmp_path / "results" / "tiny"  # recorded paths are relative to the dir above results/
    shutil.copytree(r, copy, symlinks=True)
    rows = (copy / "prompts/train.jsonl").read_text().splitlines()
    (copy / "prompts/train.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    bad = subprocess.run([PY, str(SCRIPTS / "check_provenance.py"), str(copy)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "prompts/train.jsonl" in bad.stdout and "MISMATCH" in bad.stdout


def test_snakemake_report_includes_verification(e2e, tmp_path):
    work, _, cfg = e2e
    out = tmp_path / "report.zip"
    run_snakemake(work, cfg, "--report", str(out))
    import zipfile

    names = zipfile.ZipFile(out).namelist()
    assert any(n.endswith("verification.json") for n in names), names
    assert any(n.endswith("report.html") for n in names), names
