"""Minimal rebuilds: after a complete run on the test config, each real change reruns exactly
the jobs it affects (asserted on Snakemake's dry-run plan), and running it leaves the
artifacts that should not change byte-identical.

The complete run uses the transformers backends for generation, hidden states and acceptance
(no vLLM engine start per case; the vLLM paths have their own tests) and a private copy of the
workflow, so the code-change case can edit a script without touching the repository."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_snakemake, write_config
from pipeline_lib.digests import path_digest
from test_workflow import planned_jobs

WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "scripts", "schemas", "profiles", "envs"]
AFTER_TRAIN = {"train_draft", "load_check", "contract_checks", "acceptance", "report", "compare_variants"}
AFTER_HIDDEN = {"hidden_states_shard", "hidden_states_gather"} | AFTER_TRAIN
AFTER_TOKENIZE = {"tokenize"} | AFTER_HIDDEN
AFTER_TRACES = {"traces_shard", "traces_gather"} | AFTER_TOKENIZE
VERIFY_ONLY = {"acceptance", "report", "compare_variants"}


def prompt_rows(n: int) -> list[dict]:
    topics = ["the ocean", "coffee", "chess", "rain", "trains", "bread", "music", "the moon", "bees", "maps",
              "winter", "robots", "gardens", "clocks", "rivers", "paper", "glass", "salt", "kites", "owls"]
    return [{"conversations": [{"from": "human", "value": f"Tell me one fact about {topics[i % len(topics)]} (#{i})."}]}
            for i in range(n)]


def rebuild_config(tiny_target: Path, prompts: Path) -> dict:
    from conftest import base_test_config

    cfg = base_test_config(tiny_target)
    cfg["run_name"] = "rebuild"
    cfg["prompts"]["train"] = {"source": str(prompts), "format": "sharegpt", "num_samples": None}
    cfg["prompts"]["eval"]["num_samples"] = 4
    cfg["generation"].update(backend="transformers", max_tokens=24, num_shards=2, reasoning_parser=None)
    cfg["hidden_states"].update(backend="transformers", num_shards=1)
    cfg["train"].update(epochs=1, total_seq_len=256)
    cfg["verify"].update(backend="transformers", num_prompts=4, max_tokens=16, concurrency_one_prompts=0)
    return cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("rebuilds")
    repo = root / "workflow"
    repo.mkdir()
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, repo / name)
    work = root / "work"
    work.mkdir()
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(20)))
    cfg = rebuild_config(tiny_target, prompts)
    run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    return repo, work, cfg


def clone(work: Path, dest: Path) -> Path:
    """A copy of a finished working dir (results + Snakemake metadata, mtimes preserved)."""
    shutil.copytree(work, dest, symlinks=True)
    return dest


def plan(work: Path, cfg: dict, repo: Path) -> set[str]:
    proc = run_snakemake(work, cfg, "-n", snakefile=repo / "Snakefile")
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return set()
    return set(planned_jobs(out)) - {"all"}


def artifacts(work: Path) -> dict[str, str]:
    r = work / "results" / "rebuild"
    return {name: path_digest(r / rel) for name, rel in {
        "target": "target/model", "prompts_train": "prompts/train.jsonl", "prompts_eval": "prompts/eval.jsonl",
        "traces": "traces/traces.jsonl", "tokenized": "tokenized/data",
        "hidden_states": "hidden_states/manifest.json", "final": "drafts/default/final",
    }.items()}


def test_nothing_changed_nothing_runs_even_after_dry_runs(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    assert plan(work, cfg, repo) == set()
    assert plan(work, cfg, repo) == set()  # a dry-run wrote nothing that dirties the DAG
    proc = run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    assert "Nothing to be done" in proc.stdout + proc.stderr


CASES = {
    "train_lr": (lambda c: c["train"].update(lr=0.01), AFTER_TRAIN),
    "draft_vocab_size": (lambda c: c["train"].update(draft_vocab_size=256), AFTER_TRAIN),
    "verify_k": (lambda c: c["verify"].update(num_speculative_tokens=2), VERIFY_ONLY),
    "verify_threshold": (lambda c: c["verify"]["thresholds"].update(min_mean_acceptance_length=1.1), {"report", "compare_variants"}),
    "eval_prompts": (lambda c: c["prompts"]["eval"].update(num_samples=3), {"prompts_eval"} | VERIFY_ONLY),
    "temperature": (lambda c: c["generation"].update(temperature=0.7), AFTER_TRACES),
    "max_tokens": (lambda c: c["generation"].update(max_tokens=20), AFTER_TRACES),
    "aux_layer_ids": (lambda c: c["hidden_states"].update(aux_layer_ids=[1, 3, 6]), AFTER_HIDDEN),
    "max_seq_len": (lambda c: c["tokenize"].update(max_seq_len=128), AFTER_TOKENIZE),
    "new_variant": (lambda c: c["variants"].update({"two-layers": {"draft_layers": 2}}),
                    AFTER_TRAIN),  # only the new variant's jobs + the comparison table
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_change_plans_exactly_the_affected_jobs(built, tmp_path, case):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    cfg = json.loads(json.dumps(cfg))
    change, expected = CASES[case]
    change(cfg)
    assert plan(work, cfg, repo) == expected


def test_new_variant_runs_only_its_own_jobs(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    cfg = json.loads(json.dumps(cfg))
    cfg["variants"]["small-vocab"] = {"draft_vocab_size": 256}
    proc = run_snakemake(work, cfg, "-n", snakefile=repo / "Snakefile")
    out = proc.stdout + proc.stderr
    assert "variant=small-vocab" in out
    assert "variant=default" not in out  # the existing variant is not rebuilt
    assert planned_jobs(out)["train_draft"] == 1


def test_prompt_file_content_change_reruns_prompts_and_after(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    cfg = json.loads(json.dumps(cfg))
    prompts = work / "prompts.jsonl"
    prompts.write_text(prompts.read_text() + json.dumps(prompt_rows(21)[-1]) + "\n")
    cfg["prompts"]["train"]["source"] = str(prompts)
    write_config(work, cfg)
    assert plan(work, cfg, repo) == {"prompts_train"} | AFTER_TRACES


def test_script_code_change_reruns_its_rule_and_after(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    script = repo / "scripts" / "tokenize_traces.py"
    original = script.read_text()
    try:
        script.write_text(original + "\n# a code change\n")
        assert plan(work, cfg, repo) == AFTER_TOKENIZE
    finally:
        script.write_text(original)
    assert plan(work, cfg, repo) == set()


def test_aux_layer_change_runs_and_keeps_upstream_bytes(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = json.loads(json.dumps(cfg))
    cfg["hidden_states"]["aux_layer_ids"] = [1, 3, 6]
    run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    after = artifacts(work)
    for same in ("target", "prompts_train", "prompts_eval", "traces", "tokenized"):
        assert after[same] == before[same], same
    assert after["hidden_states"] != before["hidden_states"]
    manifest = json.loads((work / "results/rebuild/hidden_states/manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 3, 6]
    final_cfg = json.loads((work / "results/rebuild/drafts/default/final/config.json").read_text())
    assert final_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]


def test_lr_change_runs_and_keeps_hidden_states(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = json.loads(json.dumps(cfg))
    cfg["train"]["lr"] = 0.01
    run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    after = artifacts(work)
    for same in ("target", "traces", "tokenized", "hidden_states"):
        assert after[same] == before[same], same
    assert after["final"] != before["final"]


def test_num_shards_change_keeps_finished_rows(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = json.loads(json.dumps(cfg))
    cfg["generation"]["num_shards"] = 3
    jobs = plan(work, cfg, repo)
    assert {"traces_shard", "traces_gather"} <= jobs
    run_snakemake(work, cfg, "results/rebuild/traces/traces.jsonl", snakefile=repo / "Snakefile")
    shards = sorted((work / "results/rebuild/traces/shards").glob("*-of-3.summary.json"))
    assert len(shards) == 3
    summaries = [json.loads(p.read_text()) for p in shards]
    assert sum(s["reused"] for s in summaries) == 20  # every row came from the cache
    assert path_digest(work / "results/rebuild/traces/traces.jsonl") == before["traces"]
