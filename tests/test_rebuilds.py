"""Minimal rebuilds: after a complete run on the test config, each row of the README's
"Rebuilds: what a change reruns" table plans exactly the jobs it says, down to the wildcards
(which variant, which stage instance, which shard), asserted on Snakemake's dry-run plan; the
cases that run also check that the artifacts that should not change stay byte-identical.

The complete run uses the transformers backends for generation, hidden states and acceptance
(no vLLM engine start per case; the vLLM paths have their own tests) and a private copy of the
workflow, so the code-change cases can edit scripts without touching the repository. Every
case works on its own copy of the finished working directory, at another path than the
original: a moved results/ (with Snakemake's .snakemake/ records) is the common ground of all
of them. The dry-run-only cases are planned together, one after the other in one Snakemake
process (conftest.plan_together); the cases that run build only what they compare.

Relocation: a second checkout of the workflow (and a venv reached through another path) with
the same results/ plans nothing; an edited script in that checkout reruns exactly its rule and
what follows."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PY, REPO, plan_together, run_snakemake, with_defaults, write_config
from pipeline_lib import stages
from pipeline_lib.digests import path_digest
from pipeline_lib.training.subset import conversations
from test_workflow import planned_job_set

WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "scripts", "schemas", "profiles", "envs"]
RUN = "rebuild"
TRACE_SHARDS, HS_SHARDS = 2, 1


def job(rule: str, **wildcards) -> tuple[str, tuple[tuple[str, str], ...]]:
    """One planned job as planned_job_set() reports it: (rule, sorted wildcard items)."""
    return rule, tuple(sorted((k, str(v)) for k, v in wildcards.items()))


COMPARE = {job("compare_variants")}
# The no-speculation baseline, measured once for every variant with the same baseline settings
# under a digest of them (rules/common.smk baseline_key); planned() writes every key as "<key>",
# test_baseline_is_shared_by_the_variants_with_its_settings checks the keys themselves.
BASELINE = job("acceptance_baseline", baseline="<key>")


def verify_jobs(variant: str) -> set:
    return {job("acceptance", variant=variant), job("report", variant=variant)}


def draft_jobs(variant: str) -> set:
    return {job(rule, variant=variant) for rule in ("train_draft", "load_check", "contract_checks")} | verify_jobs(variant)


def hidden_state_jobs(instance: str, shards: int = HS_SHARDS) -> set:
    return ({job("hidden_states_shard", hidden_states=instance, shard=i, num_shards=shards) for i in range(shards)}
            | {job("hidden_states_gather", hidden_states=instance)})


def trace_jobs(instance: str, shards: int = TRACE_SHARDS) -> set:
    return ({job("traces_shard", traces=instance, shard=i, num_shards=shards) for i in range(shards)}
            | {job("traces_gather", traces=instance)})


AFTER_TRAIN = draft_jobs("default") | COMPARE
AFTER_HIDDEN = hidden_state_jobs("hidden_states") | AFTER_TRAIN
AFTER_TOKENIZE = {job("tokenize", tokenized="tokenized")} | AFTER_HIDDEN
AFTER_TRACES = trace_jobs("traces") | AFTER_TOKENIZE
VERIFY_ONLY = verify_jobs("default") | COMPARE
# What the baseline reads changed too (a setting of BASELINE_KEYS, the eval prompts, a suite).
MEASURED = {BASELINE} | VERIFY_ONLY
# New training prompts: the e2e config's eval suite `code` re-measures its overlap with them,
# and rewrites its prompts, which the baseline measures.
TRAIN_PROMPTS = {job("prompts_train"), job("eval_suite", suite="code"), BASELINE}
CHAMP_SUITE = {"name": "math", "source": "pypi:champ_dataset/dataset_files/v0.json", "format": "champ",
               "num_samples": 2}


def prompt_rows(n: int) -> list[dict]:
    topics = ["the ocean", "coffee", "chess", "rain", "trains", "bread", "music", "the moon", "bees", "maps",
              "winter", "robots", "gardens", "clocks", "rivers", "paper", "glass", "salt", "kites", "owls"]
    return [{"conversations": [{"from": "human", "value": f"Tell me one fact about {topics[i % len(topics)]} (#{i})."}]}
            for i in range(n)]


EVAL_COPY = "eval_mtbench_first10.jsonl"


def base_eval_source() -> str:
    from conftest import base_test_config

    return base_test_config(Path("."))["prompts"]["eval"]["source"]


def _local_eval_source(c: dict) -> None:
    c["prompts"]["eval"]["source"] = str(Path(c["prompts"]["train"]["source"]).with_name(EVAL_COPY))


def rebuild_config(tiny_target: Path, prompts: Path) -> dict:
    from conftest import base_test_config

    cfg = base_test_config(tiny_target)
    cfg["run_name"] = RUN
    cfg["prompts"]["train"] = {"source": str(prompts), "format": "sharegpt", "num_samples": None}
    cfg["prompts"]["eval"]["num_samples"] = 4
    cfg["generation"].update(backend="transformers", max_tokens=24, num_shards=TRACE_SHARDS, reasoning_parser=None)
    cfg["hidden_states"].update(backend="transformers", num_shards=HS_SHARDS)
    cfg["train"].update(epochs=1, total_seq_len=256)
    # An untrained-for-long draft on a random target: the rebuild cases are about which jobs
    # run, so a missed acceptance threshold must not fail the build here.
    # No speedup rounds either: which jobs run is the point, not how fast they decode.
    cfg["verify"].update(backend="transformers", num_prompts=4, max_tokens=16, concurrency_one_prompts=0,
                         speedup_rounds=0, fail_below_threshold=False)
    return cfg


def copy_workflow(dest: Path, preserve_mtimes: bool = True) -> Path:
    """The workflow's files at `dest`. Without preserved mtimes it is what a second clone
    gives: the same content, at another path, every file newer than the first run."""
    dest.mkdir(parents=True)
    copy = shutil.copy2 if preserve_mtimes else shutil.copy
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"), copy_function=copy)
        else:
            copy(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("rebuilds")
    repo = copy_workflow(root / "workflow")
    work = root / "work"
    work.mkdir()
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(20)))
    # Another eval source for the eval-source case: the first MT-Bench questions, as a local file.
    from pipeline_lib.assets import resolve_asset

    mtbench = Path(resolve_asset(base_eval_source())).read_text().splitlines(keepends=True)
    (work / EVAL_COPY).write_text("".join(mtbench[:10]))
    cfg = rebuild_config(tiny_target, prompts)
    run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    return repo, work, cfg


@pytest.fixture(scope="module")
def moved(built, tmp_path_factory) -> Path:
    """One copy of the finished working dir at another path, shared by the dry-run-only
    tests (a dry-run writes nothing that changes a later plan: see the first test)."""
    return clone(built[1], tmp_path_factory.mktemp("moved") / "w")


def clone(work: Path, dest: Path) -> Path:
    """A copy of a finished working dir (results + Snakemake metadata, mtimes preserved)."""
    shutil.copytree(work, dest, symlinks=True)
    return dest


def planned(out: str) -> set:
    """The jobs a dry-run's output lists, as {(rule, wildcards)}; 'all' left out."""
    if "Nothing to be done" in out:
        return set()
    return {BASELINE if j[0] == BASELINE[0] else j for j in planned_job_set(out) if j[0] != "all"}


def planned_ok(proc: subprocess.CompletedProcess) -> set:
    """The jobs of one of plan_together's dry-runs, which must have succeeded."""
    assert proc.returncode == 0, f"snakemake {' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-10000:]}"
    return planned(proc.stdout)


def plan(work: Path, cfg: dict, repo: Path, *args: str) -> set:
    """The jobs a dry-run plans, in a Snakemake process of its own."""
    proc = run_snakemake(work, cfg, "-n", *args, snakefile=repo / "Snakefile")
    return planned(proc.stdout + proc.stderr)


def edited(cfg: dict, change) -> dict:
    cfg = json.loads(json.dumps(cfg))
    change(cfg)
    return cfg


def instance_dirs(cfg: dict, variant: str) -> dict[str, str]:
    """{stage: directory} of the stage instances `variant` is built from, as the workflow
    computes them (from the config with the schema's defaults)."""
    cfg = with_defaults(cfg)
    return {stage: inst.dir for stage, inst in stages.instances_for(cfg, stages.variant_config(cfg, variant)).items()}


def artifacts(work: Path) -> dict[str, str]:
    r = work / "results" / RUN
    return {name: path_digest(r / rel) for name, rel in {
        "target": "target/model", "prompts_train": "prompts/train.jsonl", "prompts_eval": "prompts/eval.jsonl",
        "traces": "traces/traces.jsonl", "tokenized": "tokenized/data",
        "hidden_states": "hidden_states/manifest.json", "final": "drafts/default/final",
        "baseline": "verify/baseline",
    }.items()}


def test_nothing_changed_nothing_runs_even_after_dry_runs(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")  # at another path: a moved results/ reruns nothing either
    assert plan(work, cfg, repo) == set()
    assert plan(work, cfg, repo) == set()  # a dry-run wrote nothing that dirties the DAG
    proc = run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    assert "Nothing to be done" in proc.stdout + proc.stderr


def _upstream_variant(section: str, change: dict):
    return lambda c: c["variants"].update({"v2": {section: change}})


CASES = {
    "train_lr": (lambda c: c["train"].update(lr=0.01), AFTER_TRAIN),
    "draft_vocab_size": (lambda c: c["train"].update(draft_vocab_size=256), AFTER_TRAIN),
    "verify_k": (lambda c: c["verify"].update(num_speculative_tokens=2), MEASURED),
    # The speedup is timed in the acceptance job alone: its settings leave the baseline as it is.
    "verify_speedup": (lambda c: c["verify"].update(speedup_rounds=4, speedup_tolerance=0.3, concurrency_one_prompts=1),
                       VERIFY_ONLY),
    "verify_eval_name": (lambda c: c["verify"].update(eval_name="chat"), {job("report", variant="default")} | COMPARE),
    "verify_threshold": (lambda c: c["verify"]["thresholds"].update(min_mean_acceptance_length=1.1),
                         {job("report", variant="default")} | COMPARE),
    "verify_serve_render_rows": (lambda c: c["verify"].update(serve_render_rows=3),
                                 {job("contract_checks", variant="default"), job("report", variant="default")} | COMPARE),
    "eval_prompts": (lambda c: c["prompts"]["eval"].update(num_samples=3), {job("prompts_eval")} | MEASURED),
    "eval_held_out_samples": (lambda c: c["prompts"].update(eval_held_out_samples=2),
                              TRAIN_PROMPTS | {job("prompts_eval")} | AFTER_TRACES),
    # Training prompts are decontaminated against the whole eval source: its n-gram length
    # (like the eval source itself) defines the training split, not the eval one here.
    "decontamination_ngram": (lambda c: c["prompts"].update(decontamination_ngram=6),
                              TRAIN_PROMPTS | AFTER_TRACES),
    # Eval suites: adding, resizing or removing one plans verification only (README rebuild table),
    # the baseline included (it measures every suite).
    "suite_added": (lambda c: c["verify"]["suites"].append(CHAMP_SUITE),
                    {job("eval_suite", suite="math")} | MEASURED),
    "suite_resized": (lambda c: c["verify"]["suites"][0].update(num_samples=1),
                      {job("eval_suite", suite="code")} | MEASURED),
    "suite_removed": (lambda c: c["verify"].update(suites=[]), MEASURED),
    "suite_settings_report_only": (lambda c: c["verify"].update(overlap_threshold=0.5, bootstrap={"seed": 3}),
                                   {job("report", variant="default")} | COMPARE),
    # Declared at training time: training prompts are decontaminated against it too.
    "decontaminate_with": (lambda c: c["prompts"].update(decontaminate_with=[{k: CHAMP_SUITE[k] for k in
                                                                                ("source", "format")}]),
                           TRAIN_PROMPTS | AFTER_TRACES),
    # The eval source (file or format) defines both splits: training rows are checked against it.
    "eval_source_file": (_local_eval_source, TRAIN_PROMPTS | {job("prompts_eval")} | AFTER_TRACES),
    # Planned only (a dry-run reads no rows): the format is part of what the split is.
    "eval_source_format": (lambda c: c["prompts"]["eval"].update(format="sharegpt"),
                           TRAIN_PROMPTS | {job("prompts_eval")} | AFTER_TRACES),
    "generation_turns": (lambda c: c["generation"].update(turns="all"), AFTER_TRACES),
    "generation_max_turns": (lambda c: c["generation"].update(turns="all", max_turns=2), AFTER_TRACES),
    "generation_source": (lambda c: c["generation"].update(source="dataset"), AFTER_TRACES),
    "temperature": (lambda c: c["generation"].update(temperature=0.7), AFTER_TRACES),
    "max_tokens": (lambda c: c["generation"].update(max_tokens=20), AFTER_TRACES),
    "aux_layer_ids": (lambda c: c["hidden_states"].update(aux_layer_ids=[1, 3, 6]), AFTER_HIDDEN),
    "max_seq_len": (lambda c: c["tokenize"].update(max_seq_len=128), AFTER_TOKENIZE),
    # The full set: every shard of the new layout, and everything after the gather.
    "trace_num_shards": (lambda c: c["generation"].update(num_shards=3), trace_jobs("traces", 3) | AFTER_TOKENIZE),
    "hidden_state_num_shards": (lambda c: c["hidden_states"].update(num_shards=2),
                                hidden_state_jobs("hidden_states", 2) | AFTER_TRAIN),
    # Resources and concurrency are not what an artifact is: nothing reruns.
    "resources": (lambda c: c.update(resources={
        "default": {"threads": 1, "mem_mb": 4000, "runtime": 30},
        "traces": {"threads": 1, "mem_mb": 16000, "runtime": 600, "gpu": 0},
        "hidden_states": {"mem_mb": 16000, "runtime": 600}, "train": {"threads": 1, "mem_mb": 32000, "runtime": 999},
        "verify": {"threads": 1, "runtime": 5}}), set()),
    # Variants: only the new variant's jobs, by wildcard, and the comparison table.
    "new_train_variant": (lambda c: c["variants"].update({"v2": {"draft_layers": 2}}), draft_jobs("v2") | COMPARE),
    # A data-scaling size: a nested subset of the same conversations, so only its draft's jobs.
    "new_size_variant": (lambda c: c["variants"].update({"v2": {"max_conversations": 8}}), draft_jobs("v2") | COMPARE),
    "new_variant_same_upstream_values": (
        _upstream_variant("generation", {"max_tokens": 24, "temperature": 0.0}), draft_jobs("v2") | COMPARE),
    # Online training: train and after rerun; nothing upstream (the hidden-state jobs leave the DAG).
    "mode_online": (lambda c: c["hidden_states"].update(mode="online"), AFTER_TRAIN),
    "storage_fp8": (lambda c: c["hidden_states"].update(storage="fp8"), AFTER_HIDDEN),
    "online_only_key_offline": (lambda c: c["hidden_states"].update(server_start_timeout_s=60), set()),
    "online_server_gpus_offline": (lambda c: c["hidden_states"].update(server_gpus=1), set()),
    "online_request_timeout_offline": (lambda c: c["hidden_states"].update(request_timeout_s=30), set()),
    # A variant training online: its own draft jobs only (no hidden-states instance at all).
    "online_variant": (_upstream_variant("hidden_states", {"mode": "online"}), draft_jobs("v2") | COMPARE),
}


FLAGS = ("--jobs", "1", "--resources", "gpu=8", "mem_mb=1000000", "--set-threads", "train_draft=1")


def upstream_variant_config(cfg: dict, section: str) -> dict:
    return edited(cfg, lambda c: c["variants"].update({"v2": {section: UPSTREAM_VARIANTS[section][0]}}))


def tok_and_gen_variants(cfg: dict) -> tuple[dict, dict]:
    tok = edited(cfg, lambda c: c["variants"].update({"tok": {"tokenize": {"max_seq_len": 96}}}))
    return tok, edited(tok, lambda c: c["variants"].update({"gen": {"generation": {"max_tokens": 12}}}))


def sharing_configs(cfg: dict) -> dict[str, dict]:
    """Variants and the baseline: a train-only variant with a new baseline-relevant verify
    setting (both variants need the new baseline); a train-only variant and one whose eval
    prompts render with other template arguments (only that one needs a baseline of its own)."""
    train_only = edited(cfg, lambda c: c["variants"].update({"v2": {"draft_layers": 2}}))
    return {"new_max_tokens": edited(train_only, lambda c: c["verify"].update(max_tokens=12)),
            "own_template": edited(train_only, lambda c: c["variants"].update(
                {"v3": {"generation": {"chat_template_kwargs": {"enable_thinking": False}}}}))}


@pytest.fixture(scope="module")
def plans(built, moved, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The dry-run-only cases' plans on the moved copy, made together in one Snakemake process
    (conftest.plan_together): {case: its dry-run}; a case whose dry-run fails fails alone. The
    unchanged config is planned last as well: what the earlier plans left in that process must
    not change a plan."""
    repo, _, cfg = built
    tok, both = tok_and_gen_variants(cfg)
    configs = {**{f"case:{case}": (edited(cfg, change), ()) for case, (change, _) in CASES.items()},
               "flags": (cfg, FLAGS),
               **{f"upstream:{section}": (upstream_variant_config(cfg, section), ()) for section in UPSTREAM_VARIANTS},
               "adding:tok": (tok, ()), "adding:both": (both, ()),
               **{f"sharing:{name}": (config, ()) for name, config in sharing_configs(cfg).items()},
               "unchanged, planned last": (cfg, ())}
    return plan_together(moved, configs, tmp_path_factory.mktemp("plans"), snakefile=repo / "Snakefile", check=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_change_plans_exactly_the_affected_jobs(plans, case):
    assert planned_ok(plans[f"case:{case}"]) == CASES[case][1]


def test_concurrency_and_resource_flags_plan_nothing(plans):
    assert planned_ok(plans["flags"]) == set()


def test_plans_made_together_leave_nothing_behind(plans):
    """After every case's plan in the same process, the unchanged config still plans nothing."""
    assert planned_ok(plans["unchanged, planned last"]) == set()


def test_baseline_is_shared_by_the_variants_with_its_settings(built, plans):
    """One acceptance_baseline job for every set of baseline settings, whatever the number of
    variants: a new verify.max_tokens plans one for two variants; a train-only variant plans
    none (it shares the built one), a variant with its own chat template arguments its own."""
    _, work, _ = built
    [built_key] = [p.stem for p in (work / "results" / RUN / "verify/baseline").glob("*.json")
                   if not p.name.endswith(".provenance.json")]

    def baselines(name: str) -> list[str]:
        proc = plans[f"sharing:{name}"]
        assert proc.returncode == 0, proc.stdout[-5000:]
        return [dict(w)["baseline"] for r, w in planned_job_set(proc.stdout) if r == BASELINE[0]]

    [new] = baselines("new_max_tokens")
    assert new != built_key
    assert {dict(w)["variant"] for r, w in planned_job_set(plans["sharing:new_max_tokens"].stdout)
            if r == "acceptance"} == {"default", "v2"}
    [own] = baselines("own_template")
    assert own not in (built_key, new)
    assert planned_ok(plans["sharing:own_template"]) >= {BASELINE, job("acceptance", variant="v3")}
    assert job("acceptance", variant="default") not in planned_ok(plans["sharing:own_template"])


UPSTREAM_VARIANTS = {
    # section of the variant's override -> the stages that get an instance of their own
    "generation": ({"max_tokens": 12}, ("traces", "tokenized", "hidden_states")),
    "tokenize": ({"max_seq_len": 96}, ("tokenized", "hidden_states")),
    "hidden_states": ({"aux_layer_ids": [1, 3, 6]}, ("hidden_states",)),
}


def variant_jobs(cfg: dict, variant: str, own: tuple[str, ...]) -> set:
    """Exactly the jobs of a variant whose own upstream instances are the stages `own`."""
    dirs = instance_dirs(cfg, variant)
    jobs = draft_jobs(variant) | COMPARE
    if "traces" in own:
        jobs |= trace_jobs(dirs["traces"])
    if "tokenized" in own:
        jobs |= {job("tokenize", tokenized=dirs["tokenized"])}
    if "hidden_states" in own:
        jobs |= hidden_state_jobs(dirs["hidden_states"])
    return jobs


@pytest.mark.parametrize("section", sorted(UPSTREAM_VARIANTS))
def test_upstream_variant_plans_its_own_stage_instances_only(built, plans, section):
    own = UPSTREAM_VARIANTS[section][1]
    cfg = upstream_variant_config(built[2], section)
    dirs = instance_dirs(cfg, "v2")
    for stage, directory in dirs.items():  # own instances get <stage>-<digest>, shared ones the base's
        assert re.fullmatch(rf"{stage}-[0-9a-f]{{10}}", directory) if stage in own else directory == stage, dirs
    assert planned_ok(plans[f"upstream:{section}"]) == variant_jobs(cfg, "v2", own)


def test_adding_a_variant_renames_nothing(built, plans):
    """Instance names depend on their own settings only: with a generation variant added next
    to a tokenize variant, the tokenize variant's jobs keep their wildcards. (Removing a
    variant: see the end of test_generation_variant_runs_and_shares_what_is_equal.)"""
    tok, both = tok_and_gen_variants(built[2])
    tok_jobs = variant_jobs(tok, "tok", ("tokenized", "hidden_states"))
    assert planned_ok(plans["adding:tok"]) == tok_jobs
    assert planned_ok(plans["adding:both"]) == tok_jobs | variant_jobs(both, "gen", ("traces", "tokenized", "hidden_states"))


def test_generation_variant_runs_and_shares_what_is_equal(built, tmp_path):
    """A generation variant for real: its own traces, tokenized data and hidden states in
    <stage>-<digest> directories, the base config's artifacts untouched byte for byte, the
    variant's provenance and report naming the instances, one comparison table and plot."""
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = edited(cfg, lambda c: c["variants"].update({"short": {"generation": {"max_tokens": 12}}}))
    dirs = instance_dirs(cfg, "short")
    run_snakemake(work, cfg, snakefile=repo / "Snakefile")
    assert artifacts(work) == before  # the base config's artifacts: same bytes, same paths
    r = work / "results" / RUN
    traces = [json.loads(line) for line in (r / dirs["traces"] / "traces.jsonl").read_text().splitlines()]
    assert traces and all(t["completion_tokens"] <= 12 for t in traces)
    assert max(t["completion_tokens"] for t in traces) == 12  # the variant's setting, not the base's 24
    train_prov = json.loads((r / "drafts/short/provenance.json").read_text())
    assert train_prov["inputs"]["data"]["path"] == f"results/{RUN}/{dirs['hidden_states']}/data"
    hs_prov = json.loads((r / dirs["hidden_states"] / "provenance.json").read_text())
    assert Path(hs_prov["inputs"]["data"]["path"]).parent.name == dirs["tokenized"]
    verification = json.loads((r / "drafts/short/report/verification.json").read_text())
    assert verification["lineage"] == {"stage_instances": dirs, "changed_settings": {"generation.max_tokens": 12}}
    assert verification["provenance"]["chain"]["intact"] and verification["provenance"]["chain"]["links_checked"] > 0
    assert dirs["traces"] in (r / "drafts/short/report/report.md").read_text()
    # The variant's acceptance read the baseline the base run measured (same bytes: not measured
    # again; the variant's eval prompts render as the base's): one baseline for both drafts.
    [baseline] = [p for p in (r / "verify/baseline").glob("*.json") if not p.name.endswith(".provenance.json")]
    for variant in ("default", "short"):
        acceptance = json.loads((r / "drafts" / variant / "verify/acceptance.json").read_text())
        assert acceptance["inputs"]["baseline"] == f"results/{RUN}/verify/baseline/{baseline.name}", variant
        prov = json.loads((r / "drafts" / variant / "verify/acceptance.provenance.json").read_text())
        assert prov["inputs"]["baseline"]["path"] == acceptance["inputs"]["baseline"], variant
    assert len(list((r / "logs/acceptance_baseline").glob("*.log"))) == 1
    import pandas as pd

    table = pd.read_csv(r / "drafts/comparison.csv").set_index("variant")
    assert set(table.index) == {"default", "short"}
    assert table.loc["short", "traces"] == dirs["traces"] and table.loc["default", "traces"] == "traces"
    assert table.loc["short", "changed_settings"] == "generation.max_tokens=12"
    html = (r / "drafts/comparison.html").read_text()
    assert html.count("data:image/png;base64,") == 1 and "short" in html and dirs["hidden_states"] in html
    check = subprocess.run([PY, str(repo / "scripts/check_provenance.py"), str(r)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # Several variants inherit one change: a train knob reruns both drafts; an upstream knob
    # both trace instances (the variant's gets a new name); a knob the variant sets itself
    # reruns the base only. Removing the variant again: only the comparison table is redone,
    # nothing is renamed. (Planned together: one Snakemake process.)
    warm = edited(cfg, lambda c: c["generation"].update(temperature=0.7))
    assert instance_dirs(warm, "short")["traces"] != dirs["traces"]
    plans = {name: planned(proc.stdout) for name, proc in plan_together(work, {
        "unchanged": (cfg, ()), "lr": (edited(cfg, lambda c: c["train"].update(lr=0.01)), ()), "warm": (warm, ()),
        "max_tokens": (edited(cfg, lambda c: c["generation"].update(max_tokens=20)), ()),
        "removed": (edited(cfg, lambda c: c["variants"].pop("short")), ()),
    }, tmp_path / "plans", snakefile=repo / "Snakefile").items()}
    assert plans == {"unchanged": set(), "lr": draft_jobs("default") | draft_jobs("short") | COMPARE,
                     "warm": AFTER_TRACES | variant_jobs(warm, "short", ("traces", "tokenized", "hidden_states")),
                     "max_tokens": AFTER_TRACES, "removed": COMPARE}


def test_prompt_file_content_change_reruns_prompts_and_after(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    cfg = json.loads(json.dumps(cfg))
    prompts = work / "prompts.jsonl"
    prompts.write_text(prompts.read_text() + json.dumps(prompt_rows(21)[-1]) + "\n")
    cfg["prompts"]["train"]["source"] = str(prompts)
    write_config(work, cfg)
    assert plan(work, cfg, repo) == TRAIN_PROMPTS | AFTER_TRACES


CODE_EDITS = {
    # an edited rule program: its rule and everything after it
    "scripts/tokenize_traces.py": AFTER_TOKENIZE,
    # an edited library module: the rules whose programs import it (here the trace shards'
    # backend registry), and what follows; nothing upstream, nothing else
    "scripts/pipeline_lib/generation/vllm_backend.py": AFTER_TRACES,
    # a module only the report and the comparison render with
    "scripts/pipeline_lib/render.py": {job("report", variant="default")} | COMPARE,
    # the plan-time checks (`snakemake -n` and plan.py): no rule's program imports them
    "scripts/pipeline_lib/stages.py": set(),
}


@pytest.mark.parametrize("path", sorted(CODE_EDITS))
def test_code_change_reruns_its_rules_and_after(built, moved, tmp_path, path):
    repo, _, cfg = built
    work = moved
    checkout = copy_workflow(tmp_path / "checkout")
    (checkout / path).write_text((checkout / path).read_text() + "\n# a code change\n")
    assert plan(work, cfg, checkout) == CODE_EDITS[path]


# The cases that run build up to the trained draft: the bytes they compare are upstream of
# verification, and which verification jobs a change reruns is planned above.
FINAL = f"results/{RUN}/drafts/default/final"


def test_size_variants_train_nested_subsets_and_the_comparison_scales(built, tmp_path):
    """Two data-scaling sizes for real on the finished run: nothing upstream is redone (same
    bytes), each draft trains on its nested subset (the view's source rows), its provenance
    counts them, and the comparison shows tau against conversations and the last step."""
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = edited(cfg, lambda c: c["variants"].update({"conv-6": {"max_conversations": 6},
                                                      "conv-12": {"max_conversations": 12}}))
    run_snakemake(work, cfg, f"results/{RUN}/drafts/comparison.md", snakefile=repo / "Snakefile")
    assert artifacts(work) == before
    r = work / "results" / RUN
    total = len(conversations(json.loads((r / "tokenized/stats.json").read_text())["row_ids"]))
    rows, used = {}, {}
    for n in (6, 12):
        rows[n] = json.loads((r / f"drafts/conv-{n}/checkpoints/data-subset/rows.json").read_text())["rows"]
        used[n] = json.loads((r / f"drafts/conv-{n}/provenance.json").read_text())["training_data"]
        assert used[n]["conversations"] == n and used[n]["of_conversations"] == total and used[n]["rows"] == len(rows[n])
    assert set(rows[6]) < set(rows[12])
    assert json.loads((r / "drafts/default/provenance.json").read_text())["training_data"]["conversations"] == total
    md = (r / "drafts/comparison.md").read_text()
    scaling = md.split("Data scaling: acceptance against training conversations")[1]
    for variant, n in (("conv-6", 6), ("conv-12", 12), ("default", total)):
        assert re.search(rf"^\| {variant} \| \(base config\) \| {n} of {total} \|", scaling, re.M), scaling
    assert f"conv-12 (12) -> default ({total}) | {total - 12} |" in scaling
    assert 'alt="Mean acceptance length against training conversations"' in (r / "drafts/comparison.html").read_text()


def test_aux_layer_change_runs_and_keeps_upstream_bytes(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = json.loads(json.dumps(cfg))
    cfg["hidden_states"]["aux_layer_ids"] = [1, 3, 6]
    run_snakemake(work, cfg, FINAL, snakefile=repo / "Snakefile")
    after = artifacts(work)
    for same in ("target", "prompts_train", "prompts_eval", "traces", "tokenized"):
        assert after[same] == before[same], same
    assert after["hidden_states"] != before["hidden_states"]
    manifest = json.loads((work / f"results/{RUN}/hidden_states/manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 3, 6]
    final_cfg = json.loads((work / f"results/{RUN}/drafts/default/final/config.json").read_text())
    assert final_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]


def test_lr_change_runs_and_keeps_hidden_states(built, tmp_path):
    repo, work, cfg = built
    work = clone(work, tmp_path / "w")
    before = artifacts(work)
    cfg = json.loads(json.dumps(cfg))
    cfg["train"]["lr"] = 0.01
    run_snakemake(work, cfg, FINAL, snakefile=repo / "Snakefile")
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
    run_snakemake(work, cfg, f"results/{RUN}/traces/traces.jsonl", snakefile=repo / "Snakefile")
    shards = sorted((work / f"results/{RUN}/traces/shards").glob("*-of-3.summary.json"))
    assert len(shards) == 3
    summaries = [json.loads(p.read_text()) for p in shards]
    assert sum(s["reused"] for s in summaries) == 20  # every row came from the cache
    assert path_digest(work / f"results/{RUN}/traces/traces.jsonl") == before["traces"]


# --------------------------------------------------------------------------------- relocation


def test_second_checkout_plans_nothing_and_edits_there_rerun_by_content(built, moved, tmp_path):
    """The same results/ driven from another checkout (other path, fresh mtimes: a second
    clone) plans nothing; editing a script in that checkout plans its rule and what follows."""
    repo, _, cfg = built
    work = moved
    second = copy_workflow(tmp_path / "second-clone", preserve_mtimes=False)
    assert plan(work, cfg, second) == set()
    script = second / "scripts" / "tokenize_traces.py"
    script.write_text(script.read_text() + "\n# a code change\n")
    assert plan(work, cfg, second) == AFTER_TOKENIZE
    assert plan(work, cfg, repo) == set()  # the first checkout still has the recorded code


def test_venv_at_another_path_plans_nothing(built, moved, tmp_path):
    """The same venv reached through another path (as after moving or recreating it
    elsewhere): pypi: assets resolve inside it, at other absolute paths, with the same bytes."""
    repo, _, cfg = built
    work = moved
    moved = tmp_path / "venv-elsewhere"
    moved.symlink_to(Path(sys.prefix), target_is_directory=True)
    python = moved / "bin" / Path(PY).name
    env = {**os.environ, "PATH": f"{moved / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    where = subprocess.run([str(python), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "from pipeline_lib.assets import resolve_asset; print(resolve_asset(sys.argv[2]))",
                            str(repo / "scripts"), cfg["prompts"]["eval"]["source"]],
                           capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert where.startswith(str(moved)), where  # the asset's path did change
    proc = subprocess.run([str(python), "-m", "snakemake", "-s", str(repo / "Snakefile"), "-d", str(work),
                           "--configfile", str(write_config(work, cfg)), "--cores", "2", "-n"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr, planned_job_set(proc.stdout + proc.stderr)
