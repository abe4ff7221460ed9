"""train.draft_type through the rules: EAGLE-3, P-EAGLE and DFlash variants of one config on the
tiny target share every upstream artifact, and each goes through training, vLLM's load check,
its own contract checks, acceptance in vLLM and the report; the comparison page ranks the
types. Types vLLM cannot serve here, or the chain cannot measure, are refused at plan time
with the engine's reason. The parallel types' own contract checks fail on planted drafts."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

import check_contract
from conftest import base_test_config, run_snakemake
from pipeline_lib import contract as contract_lib
from pipeline_lib import draft_types
from pipeline_lib.errors import PipelineError
from pipeline_lib.render import render_markdown
from pipeline_lib.report import type_ranking
from pipeline_lib.stages import check_variants
from pipeline_lib.training.settings import TrainSettings
from pipeline_lib.training.trainer import type_flags

# Small blocks and few anchors: DFlash's training mask is block x anchors wide, and its default
# (block 16, 512 anchors) takes minutes per epoch on 2 cores. k = 3 fits every one of them.
VARIANTS = {"default": {},
            "peagle": {"draft_type": "peagle", "num_depths": 4, "max_anchors": 64},
            "dflash": {"draft_type": "dflash", "block_size": 4, "max_anchors": 64}}


def config(tiny_target, variants=None, **verify) -> dict:
    cfg = base_test_config(tiny_target)
    cfg["variants"] = variants or VARIANTS
    # Accepting nothing is a result here, not a build failure: the types are compared, not graded.
    cfg["verify"]["thresholds"] = {}
    # Compared by acceptance: no speedup rounds (their engines would double each acceptance job),
    # and one shard per stage (the shards' own tests are elsewhere; each shard starts an engine).
    cfg["verify"]["speedup_rounds"] = 0
    cfg["generation"]["num_shards"] = cfg["hidden_states"]["num_shards"] = 1
    cfg["verify"].update(verify)
    return cfg


@pytest.fixture(scope="module")
def chain(tiny_target, tmp_path_factory):
    work = tmp_path_factory.mktemp("draft_types")
    run_snakemake(work, config(tiny_target), timeout=1800)
    return work / "results" / "tiny"


def read(path):
    return json.loads(path.read_text())


# -------------------------------------------------------------------------- the whole chain

def test_types_share_every_upstream_artifact(chain):
    assert sorted(p.name for p in chain.iterdir() if p.name.startswith(("traces", "tokenized", "hidden_states"))) \
        == ["hidden_states", "tokenized", "traces"]
    for variant in VARIANTS:
        lineage = read(chain / f"drafts/{variant}/report/verification.json")["lineage"]["stage_instances"]
        assert lineage == {"traces": "traces", "tokenized": "tokenized", "hidden_states": "hidden_states"}, variant


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_type_is_trained_loaded_checked_and_measured_in_vllm(chain, variant):
    kind = VARIANTS[variant].get("draft_type", "eagle3")
    t = draft_types.get(kind)
    final = read(chain / f"drafts/{variant}/final/config.json")
    assert final["speculators_model_type"] == kind
    assert final["architectures"] == [t.architecture]
    assert final[t.aux_layers_key] == [2, 4, 5]
    argv = read(chain / f"drafts/{variant}/provenance.json")["trainer_argv"]
    assert argv[argv.index("--speculator-type") + 1] == kind
    assert ("--ttt-steps" in argv) == (kind == "eagle3")

    load = read(chain / f"drafts/{variant}/load_check.json")
    assert load["ok"] and load["draft_type"] == kind
    assert load["speculative_config"]["method"] == t.vllm_method
    assert load["speculative_config"].get("parallel_drafting", False) == (kind == "peagle")
    assert load["spec_decode"]["num_drafts"] > 0

    contract = read(chain / f"drafts/{variant}/verify/contract.json")
    assert contract["passed"] and contract["draft_type"] == kind, contract["summary"]
    names = [c["name"] for c in contract["checks"]]
    assert names == [name for name, _ in contract_lib.checks_for(kind)]
    assert ("parallel.speculative_tokens" in names) == t.parallel_drafting
    assert ("embeddings.match_target" in names) == (kind == "eagle3")

    acceptance = read(chain / f"drafts/{variant}/verify/acceptance.json")
    assert acceptance["status"] == "ok"
    trained = acceptance["acceptance"]["trained"]
    assert trained["num_drafts"] > 0 and trained["mean_acceptance_length"] >= 1.0
    # verify.speedup_rounds 0: no speedup engines started, and the record says why.
    assert acceptance["timing"]["speedup_engines"] == {"not_asked": "verify.speedup_rounds is 0"}
    assert acceptance["throughput"]["speedup"] is None
    assert acceptance["throughput"]["speedup_not_measured"] == "no speedup rounds ran (verify.speedup_rounds is 0)"
    assert "[speedup]" not in (chain / f"logs/acceptance/{variant}.log").read_text()

    report = read(chain / f"drafts/{variant}/report/verification.json")
    assert report["training"]["draft_type"] == kind
    assert report["training"]["draft_parameters"]["without_embeddings"] > 0
    assert report["training"]["train_step_s"] > 0
    assert any(k.startswith("acc_") for k in report["training"]["selected_val"])


def test_comparison_ranks_the_types_per_suite(chain):
    page = (chain / "drafts/comparison.md").read_text()
    section = page[page.index("## Draft types compared"):]
    for title in ("EAGLE-3", "P-EAGLE", "DFlash"):
        assert title in section
    assert "MT-Bench: tau [95%]" in section and "code (HumanEval): tau [95%]" in section
    assert "vs default (paired) [95%]" in section and "speedup at concurrency 1 [95%]" in section
    html = (chain / "drafts/comparison.html").read_text()
    assert "Draft types compared" in html
    import csv
    rows = {r["variant"]: r for r in csv.DictReader((chain / "drafts/comparison.csv").open())}
    assert {v: rows[v]["draft_type"] for v in VARIANTS} == {"default": "eagle3", "peagle": "peagle", "dflash": "dflash"}
    assert int(rows["dflash"]["draft_parameters"]) < int(rows["default"]["draft_parameters"])  # no embeddings, no 2H layer


def _report(variant, kind, accepted, c1=None):
    """A verification.json with 20 MT-Bench requests, each 10 drafts and `accepted` tokens."""
    requests = [{"id": f"q{i}", "suite": "eval", "num_drafts": 10, "num_accepted_tokens": accepted + (i % 2)}
                for i in range(20)]
    tau = 1 + (accepted + 0.5) / 10
    return {"variant": variant, "training": {"draft_type": kind, "draft_parameters": {"total": 2, "without_embeddings": 1}},
            "suites": {"trained": {"figures": {"eval": {"mean_acceptance_length": tau, "interval": [tau - 0.1, tau + 0.1]}}},
                       "labels": {"eval": "MT-Bench"}, "bootstrap": {"samples": 200, "seed": 0}},
            "acceptance": {"requests": {"trained": requests},
                           "throughput": {"concurrency_1": {"speedup": c1, "interval": [c1 - 0.1, c1 + 0.1]} if c1 else
                                          {"speedup": None, "reason": "rounds disagree"}}}}


def test_ranking_orders_by_tau_against_eagle3_and_by_speedup():
    reports = [_report("dflash", "dflash", 9, c1=1.5), _report("base", "eagle3", 5, c1=1.2),
               _report("peagle", "peagle", 5)]
    ranked = type_ranking.rankings(reports)["eval"]
    assert [r["variant"] for r in ranked] == ["dflash", "base", "peagle"]
    assert ranked[0]["vs_reference"]["difference"] == pytest.approx(0.4) and ranked[0]["vs_reference"]["differs"]
    assert ranked[1]["vs_reference"] is None  # the EAGLE-3 variant is the reference, wherever it ranks
    assert ranked[2]["vs_above"]["difference"] == 0 and not ranked[2]["vs_above"]["differs"]
    assert [c["variant"] for c in type_ranking.cost_rows(reports)] == ["dflash", "base", "peagle"]
    text = render_markdown(type_ranking.sections(reports), "x.html")
    assert "+0.400 [+0.400, +0.400] *" in text and "not measured (rounds disagree)" in text


def test_a_single_type_gets_no_type_ranking(tmp_path):
    reports = [{"variant": "a", "training": {"draft_type": "eagle3"}}, {"variant": "b", "training": {}}]
    assert type_ranking.sections(reports) == []


# -------------------------------------------------------------------------- plan-time refusals

@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_dry_run_refuses_a_type_vllm_cannot_serve_on_cpu(tiny_target, tmp_path, kind):
    proc = run_snakemake(tmp_path, config(tiny_target, {"default": {}, "x": {"draft_type": kind}}), "-n", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "variants.x.train.draft_type" in out
    assert draft_types.get(kind).unservable["cpu"].engine_error in out
    assert "results/tiny/traces" not in out  # refused before any job is planned


@pytest.mark.parametrize("kind, quoted", [("xpress", "Please ensure you're loading a speculators-format model"),
                                          ("mtp", "Unsupported MTP model type 'llama'")])
def test_types_no_engine_can_serve_are_refused_everywhere(tiny_target, kind, quoted):
    cfg = config(tiny_target, {"default": {}, "x": {"draft_type": kind}})
    for gpu in (0, 1):
        cfg["resources"]["verify"] = {"threads": 1, "gpu": gpu}
        with pytest.raises(PipelineError) as err:
            check_variants(cfg, {})
        assert "variants.x.train.draft_type" in str(err.value) and quoted in str(err.value)


def test_refusals_for_what_the_chain_cannot_measure(tiny_target):
    cfg = config(tiny_target, {"x": {"draft_type": "peagle"}}, backend="transformers")
    with pytest.raises(PipelineError, match="verify.backend transformers measures EAGLE-3 drafts only"):
        check_variants(cfg, {})
    # block 3 trains 2 tokens per step: serving k = 3 would draft a position it never learnt
    cfg = config(tiny_target, {"x": {"draft_type": "dflash", "block_size": 3}})
    with pytest.raises(PipelineError, match=r"proposes 2 tokens per step .* verify.num_speculative_tokens = 3"):
        check_variants(cfg, {})
    cfg = config(tiny_target, {"x": {"draft_type": "peagle", "num_depths": 2}})
    with pytest.raises(PipelineError, match="train.num_depths"):
        check_variants(cfg, {})
    cfg = config(tiny_target, {"x": {"block_size": 4}})  # an eagle3 variant
    with pytest.raises(PipelineError, match="variants.x: setting train.block_size = 4: only draft types dflash"):
        check_variants(cfg, {})
    check_variants(config(tiny_target), {})  # the chain's own config plans


def test_only_the_types_flags_reach_speculators(tiny_target):
    base = base_test_config(tiny_target)["train"]
    assert type_flags(TrainSettings.from_dict(base)) == ["--ttt-steps", "3"]
    assert type_flags(TrainSettings.from_dict({**base, "draft_type": "dflash", "block_size": 4, "max_anchors": 64})) \
        == ["--block-size", "4", "--max-anchors", "64"]
    assert type_flags(TrainSettings.from_dict({**base, "draft_type": "peagle"})) == []
    with pytest.raises(PipelineError, match="train.num_depths = 4: only draft types peagle take it"):
        TrainSettings.from_dict({**base, "draft_type": "dflash", "num_depths": 4})


# -------------------------------------------------------------------------- planted failures

def _contract(monkeypatch, r, draft, out, settings) -> dict:
    monkeypatch.setattr(sys, "argv", [
        "check_contract.py", "--settings", json.dumps(settings), "--target", str(r / "target/model"),
        "--target-manifest", str(r / "target/manifest.json"), "--tokenized-stats", str(r / "tokenized/stats.json"),
        "--tokenized-data", str(r / "tokenized/data"), "--traces", str(r / "traces/traces.jsonl"),
        "--hs-record", str(r / "drafts/default/hidden_states.json"),
        "--hs-manifest", str(r / "hidden_states/manifest.json"), "--draft", str(draft), "--out", str(out)])
    assert check_contract.main() == 0
    return read(out)


def _edited(src, dest, **fields):
    """A copy of a draft with config fields changed, its verifier path re-pointed at the target."""
    shutil.copytree(src, dest)
    cfg = read(dest / "config.json")
    target = src.parents[2] / "target/model"
    cfg["speculators_config"]["verifier"]["name_or_path"] = os.path.relpath(target.resolve(), dest.resolve())
    cfg.update(fields)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# check -> (variant, plant (good draft, new dir) -> planted draft, the settings the contract runs with)
PARALLEL_PLANTS = {
    # A block-4 DFlash draft (3 tokens per step) served with k = 5: vLLM runs it without complaint.
    "parallel.speculative_tokens": ("dflash", lambda src, dest: _edited(src, dest),
                                    {"draft_type": "dflash", "num_speculative_tokens": 5}),
    "parallel.mask_token_id": ("peagle", lambda src, dest: _edited(src, dest, mask_token_id=99999),
                               {"draft_type": "peagle", "num_speculative_tokens": 3}),
}


@pytest.mark.parametrize("check", sorted(PARALLEL_PLANTS))
def test_planted_parallel_mismatch_fails_its_check(chain, tmp_path, monkeypatch, check):
    variant, plant, settings = PARALLEL_PLANTS[check]
    draft = plant(chain / f"drafts/{variant}/final", tmp_path / "planted")
    result = _contract(monkeypatch, chain, draft, tmp_path / "contract.json", settings)
    failed = {c["name"] for c in result["checks"] if c["passed"] is False}
    assert failed == {check}, result["summary"]
    assert not result["passed"]


def test_block_size_and_trained_tokens_must_agree(chain, tmp_path, monkeypatch):
    draft = _edited(chain / "drafts/dflash/final", tmp_path / "planted", block_size=8)
    result = _contract(monkeypatch, chain, draft, tmp_path / "contract.json", {"draft_type": "dflash"})
    check = next(c for c in result["checks"] if c["name"] == "parallel.speculative_tokens")
    assert check["passed"] is False and "disagrees with block_size 8" in check["detail"]


def test_a_draft_of_another_type_fails_the_type_check(chain, tmp_path, monkeypatch):
    """The EAGLE-3 draft checked as the variant's DFlash: the type check names both and what to do."""
    result = _contract(monkeypatch, chain, chain / "drafts/default/final", tmp_path / "contract.json",
                       {"draft_type": "dflash", "num_speculative_tokens": 3})
    check = next(c for c in result["checks"] if c["name"] == "config.speculators_model_type")
    assert check["passed"] is False and "train.draft_type is 'dflash'" in check["detail"]
    assert not result["passed"]
