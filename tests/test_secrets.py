"""Credentials never reach logs, provenance or reports (pipeline_lib/secrets.py).

A token planted in a setting of the config (an endpoint URL with a password or a key), in a
script's command line, and in an exception message; after each, every file the run wrote is
searched for it, as are the process's own stdout and stderr. (The e2e run covers tokens in the
environment: test_e2e.test_no_secret_lands_in_any_file_the_run_wrote.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import base_test_config, run_script, run_snakemake

TOKEN = "hf_PlantedSecretToken1234567890abcd"
KEY = "sk-plantedOpenAIKey0987654321zyx"


def files_holding(root: Path, *secrets: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path}: {s[:6]}..." for s in secrets if s.encode() in data]
    return found


@pytest.mark.parametrize("endpoint, setting", [
    (f"http://user:{TOKEN}@127.0.0.1:8000/v1", "generation.endpoint"),      # a token as URL password
    ("http://user:s3cretPassw0rd@127.0.0.1:8000/v1", "generation.endpoint"),  # any URL password
    (f"http://127.0.0.1:8000/v1?api_key={KEY}", "generation.endpoint"),     # key as a query parameter
])
def test_a_credential_in_the_config_is_refused_before_anything_is_written(
        endpoint, setting, reasoning_target, tmp_path):
    cfg = base_test_config(reasoning_target)
    cfg["generation"].update(backend="openai", endpoint=endpoint)
    proc = run_snakemake(tmp_path, cfg, "-n", check=False)
    (tmp_path / "config.test.yaml").unlink()  # the test's own input: the user wrote the secret there
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"config setting(s) {setting} hold a credential" in out and "OPENAI_API_KEY" in out
    assert not any(secret in out for secret in (TOKEN, KEY, "s3cretPassw0rd"))
    assert not files_holding(tmp_path, TOKEN, KEY, "s3cretPassw0rd")  # .snakemake/ logs and metadata included


def test_a_real_run_with_credentials_in_two_settings_refuses_before_results_exist(reasoning_target, tmp_path):
    """Not a dry-run: the run itself refuses at parse time, naming every setting that holds a
    credential, and creates no results/ (nothing could be written that quotes them)."""
    cfg = base_test_config(reasoning_target)
    cfg["generation"].update(backend="openai", endpoint=f"http://user:{TOKEN}@127.0.0.1:8000/v1")
    cfg["verify"]["reference_draft"] = f"https://models.example.com/ref?api_key={KEY}"
    proc = run_snakemake(tmp_path, cfg, check=False, timeout=300)
    (tmp_path / "config.test.yaml").unlink()
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "config setting(s) generation.endpoint, verify.reference_draft hold a credential" in out
    assert not (tmp_path / "results").exists()
    assert TOKEN not in out and KEY not in out
    assert not files_holding(tmp_path, TOKEN, KEY)


def test_credentials_in_argv_and_settings_stay_out_of_outputs_provenance_and_logs(e2e, tmp_path):
    """A script run by hand with a credential-bearing setting on its command line (a
    reference draft given as a URL with a password): the contract record quotes the setting
    in its reference error, provenance records settings and argv, the report repeats them."""
    r = e2e.results
    reference = f"https://user:{TOKEN}@models.example.com/drafts/ref"
    out = tmp_path / "verify" / "contract.json"
    proc = run_script("check_contract.py", "--settings", json.dumps({"reference_draft": reference}),
                      "--target", r / "target/model", "--target-manifest", r / "target/manifest.json",
                      "--draft", r / "drafts/default/final", "--hs-manifest", r / "hidden_states/manifest.json",
                      "--tokenized-stats", r / "tokenized/stats.json", "--tokenized-data", r / "tokenized/data",
                      "--traces", r / "traces/traces.jsonl", "--hs-record", r / "drafts/default/hidden_states.json",
                      "--out", out)
    contract = json.loads(out.read_text())
    ref = next(c for c in contract["checks"] if c["name"] == "reference_draft.config")
    assert ref["passed"] is False and "<redacted>@models.example.com" in ref["detail"]  # still says what failed
    prov = json.loads((tmp_path / "verify/contract.provenance.json").read_text())
    assert "<redacted>" in prov["command"] and "<redacted>" in prov["settings"]["reference_draft"]

    report = run_script("make_report.py", "--settings", json.dumps({"reference_draft": reference}),
                        "--variant", "default", "--contract", out,
                        "--acceptance", r / "drafts/default/verify/acceptance.json",
                        "--metrics", r / "drafts/default/train_metrics.csv", "--out-dir", tmp_path / "report",
                        cwd=e2e.work)
    assert "reference_draft" in (tmp_path / "report/report.md").read_text()
    for p in (proc, report):
        assert TOKEN not in p.stdout + p.stderr
    assert not files_holding(tmp_path, TOKEN)


def test_credentials_in_exception_messages_are_scrubbed(e2e, tmp_path):
    """Errors quote what they were given: a path (a clean PipelineError) and a setting's value
    (an unexpected exception, printed with its traceback) both carry the token here."""
    r = e2e.results
    missing = tmp_path / f"token={TOKEN}" / "traces.jsonl"
    args = ["--target", r / "target/model", "--manifest", r / "target/manifest.json",
            "--out-data", tmp_path / "tok/data", "--token-freq", tmp_path / "tok/token_freq.pt",
            "--stats", tmp_path / "tok/stats.json", "--provenance", tmp_path / "tok/provenance.json"]
    clean = run_script("tokenize_traces.py", "--traces", missing, *args, check=False, timeout=300)
    assert clean.returncode == 2 and "traces file not found" in clean.stderr
    assert "<redacted>" in clean.stderr

    traces = tmp_path / "traces.jsonl"
    shutil.copy(r / "traces/traces.jsonl", traces)
    crash = run_script("tokenize_traces.py", "--settings", json.dumps({"max_seq_len": TOKEN}), "--traces", traces,
                       *args, check=False, timeout=300)
    assert crash.returncode == 1 and "Traceback" in crash.stderr and "ValueError" in crash.stderr
    assert "<redacted>" in crash.stderr
    for p in (clean, crash):
        assert TOKEN not in p.stdout + p.stderr
    assert not files_holding(tmp_path, TOKEN)


def test_scrub_keeps_text_and_removes_credential_shapes(monkeypatch):
    from pipeline_lib.config_credentials import credential_settings
    from pipeline_lib.secrets import scrub

    monkeypatch.setenv("MY_SERVICE_TOKEN", "plain-value-without-shape")
    text = (f"GET http://u:s3cretPassw0rd@h/v1?api_key={KEY}&x=1 auth Bearer abcdefgh12345678 with "
            f"plain-value-without-shape and {TOKEN} in results/hf_cache/model")
    clean = scrub(text)
    for secret in ("s3cretPassw0rd", TOKEN, KEY, "abcdefgh12345678", "plain-value-without-shape"):
        assert secret not in clean
    assert clean.startswith("GET http://u:<redacted>@h/v1?") and clean.endswith("in results/hf_cache/model")
    assert credential_settings({"a": {"b": [f"x{TOKEN}"]}, "c": "results/hf_cache", "d": 3}) == ["a.b[0]"]
