"""Variants at every stage: which stage instances each variant gets (pipeline_lib/stages.py),
how a bad variant is reported, and the dry-run of a config with many variants. The exact job
sets each kind of variant adds after a finished run are in test_rebuilds.py."""
from __future__ import annotations

import copy
import json
import re
import time

import pytest

from conftest import run_snakemake, with_defaults
from pipeline_lib import stages
from pipeline_lib.errors import PipelineError
from test_workflow import planned_job_set, planned_jobs


def lineage(cfg: dict, variant: str) -> dict[str, str]:
    """{stage: directory} of `variant`'s stage instances, computed as the workflow does."""
    cfg = with_defaults(cfg)
    return {stage: inst.dir for stage, inst in stages.instances_for(cfg, stages.variant_config(cfg, variant)).items()}


def with_variants(cfg: dict, variants: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["variants"] = variants
    return cfg


@pytest.fixture
def cfg(test_config):
    return with_defaults(test_config)


def test_each_section_gets_instances_from_its_stage_on(cfg):
    cfg = with_variants(cfg, {
        "default": {}, "lr": {"lr": 0.01}, "lr-long": {"train": {"lr": 0.01}},
        "gen": {"generation": {"max_tokens": 12}}, "tok": {"tokenize": {"max_seq_len": 96}},
        "hs": {"hidden_states": {"aux_layer_ids": [1, 3, 6]}},
        "kwargs": {"generation": {"chat_template_kwargs": {"enable_thinking": False}}},
        "same-as-base": {"generation": {"max_tokens": cfg["generation"]["max_tokens"]}, "tokenize": {}},
    })
    base = {"traces": "traces", "tokenized": "tokenized", "hidden_states": "hidden_states"}
    for name in ("default", "lr", "lr-long", "same-as-base"):
        assert lineage(cfg, name) == base, name
    gen, tok, hs = lineage(cfg, "gen"), lineage(cfg, "tok"), lineage(cfg, "hs")
    assert all(re.fullmatch(rf"{s}-[0-9a-f]{{10}}", gen[s]) for s in base)
    assert tok["traces"] == "traces" and tok["tokenized"] != "tokenized" and tok["hidden_states"] != "hidden_states"
    assert hs["tokenized"] == "tokenized" and hs["hidden_states"] != "hidden_states"
    # chat_template_kwargs belongs to generation but also defines the tokenized data.
    kw = lineage(cfg, "kwargs")
    assert kw["traces"] != "traces" and kw["tokenized"] != "tokenized"
    # Shorthand and train: section are the same variant; a train-only variant keeps the base chain.
    assert stages.variant_config(cfg, "lr")["train"] == stages.variant_config(cfg, "lr-long")["train"]
    _, by_dir = stages.plan_instances(cfg)
    assert len({i.dir for i in by_dir.values() if i.stage == "hidden_states"}) == 5  # base, gen, tok, hs, kwargs
    assert by_dir[gen["tokenized"]].reads == gen["traces"] and by_dir[tok["tokenized"]].reads == "traces"
    assert by_dir[gen["traces"]].settings["max_tokens"] == 12


def test_names_depend_on_their_settings_only(cfg):
    one = with_variants(cfg, {"default": {}, "gen": {"generation": {"max_tokens": 12}}})
    many = with_variants(cfg, {"a": {"tokenize": {"max_seq_len": 96}}, "renamed": {"generation": {"max_tokens": 12}},
                               "z": {"hidden_states": {"num_shards": 3}}})
    assert lineage(one, "gen") == lineage(many, "renamed")
    # Two variants with equal settings share every instance.
    twins = with_variants(cfg, {"x": {"generation": {"max_tokens": 12}}, "y": {"generation": {"max_tokens": 12}, "lr": 0.1}})
    assert lineage(twins, "x") == lineage(twins, "y")
    # A different base makes the variant's settings differ from it in another way: new name.
    other_base = copy.deepcopy(one)
    other_base["generation"]["temperature"] = 0.5
    assert lineage(other_base, "gen")["traces"] != lineage(one, "gen")["traces"]


def test_changed_settings_lists_what_differs_from_the_base(cfg):
    cfg = with_variants(cfg, {"v": {"lr": 0.01, "epochs": cfg["train"]["epochs"],
                                    "generation": {"max_tokens": 12}, "tokenize": {"overlength": "drop"}}})
    assert stages.changed_settings(cfg, "v") == {"generation.max_tokens": 12, "tokenize.overlength": "drop",
                                                 "train.lr": 0.01}


@pytest.mark.parametrize("variant, needle", [
    ({"lr": 0.1, "train": {"lr": 0.2}}, "variants.bad: lr given both directly and under train"),
    ({"verify": {"num_speculative_tokens": 2}}, "variants.bad: verify cannot differ between variants"),
])
def test_ambiguous_or_shared_overrides_are_named(cfg, variant, needle):
    with pytest.raises(PipelineError, match=re.escape(needle)):
        stages.variant_config(with_variants(cfg, {"bad": variant}), "bad")


@pytest.mark.parametrize("variant, needle", [
    ({"generation": {"max_tokenz": 10}}, "variants.bad: generation: Additional properties are not allowed ('max_tokenz'"),
    ({"hidden_states": {"aux_layer_ids": "2,4"}}, "variants.bad: hidden_states.aux_layer_ids: '2,4' is not of type"),
    ({"lr": "fast"}, "variants.bad: train.lr: 'fast' is not of type 'number'"),
    ({"draft_layerz": 2}, "variants.bad: train: Additional properties are not allowed ('draft_layerz'"),
])
def test_bad_variant_fails_the_dry_run_naming_variant_and_key(tmp_path, cfg, variant, needle):
    proc = run_snakemake(tmp_path, with_variants(cfg, {"default": {}, "bad": variant}), "-n", check=False)
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert not (tmp_path / "results").exists()


def test_many_variants_dry_run_plans_each_instance_once(tmp_path, cfg):
    """122 variants over every section (31 trace, 61 tokenized, 62 hidden-state instances): the
    plan has one job per instance and shard, each instance with its own num_shards, and stays
    quick (the measured figure is printed; the README quotes it)."""
    variants = {"default": {}}
    for i in range(30):
        variants[f"lr{i}"] = {"lr": 0.001 * (i + 1)}
        variants[f"gen{i}"] = {"generation": {"max_tokens": 10 + i}}
        variants[f"gen{i}-lr"] = {"generation": {"max_tokens": 10 + i}, "train": {"lr": 0.5}}
        variants[f"tok{i}"] = {"tokenize": {"max_seq_len": 64 + i}}
    variants["hs-shards"] = {"hidden_states": {"num_shards": 3}}  # its own instance, in 3 shards
    cfg = with_variants(cfg, variants)
    start = time.time()
    proc = run_snakemake(tmp_path, cfg, "-n")
    elapsed = time.time() - start
    print(f"dry-run of {len(variants)} variants: {elapsed:.1f} s")
    jobs = planned_jobs(proc.stdout + proc.stderr)
    shards = cfg["generation"]["num_shards"], cfg["hidden_states"]["num_shards"]
    assert jobs["traces_gather"] == 31 and jobs["traces_shard"] == 31 * shards[0]
    assert jobs["tokenize"] == 61 and jobs["hidden_states_gather"] == 62
    assert jobs["hidden_states_shard"] == 61 * shards[1] + 3
    assert jobs["train_draft"] == jobs["report"] == len(variants) and jobs["compare_variants"] == 1
    listed = planned_job_set(proc.stdout + proc.stderr)
    assert {w for r, w in listed if r == "tokenize"} == {(("tokenized", d),) for d in
                                                         {lineage(cfg, v)["tokenized"] for v in variants}}
    assert elapsed < 120, f"dry-run of {len(variants)} variants took {elapsed:.1f} s"


def test_measurement_renders_prompts_as_the_variant_generated_them(tmp_path, cfg):
    """A variant's acceptance measurement takes its own generation template arguments (eval
    prompts are rendered like the training prompts); the base variant keeps the base's."""
    cfg = with_variants(cfg, {"default": {}, "no-think": {"generation": {"chat_template_kwargs": {"enable_thinking": False}}}})
    out = run_snakemake(tmp_path, cfg, "-n").stdout
    commands = {m.group(1): m.group(0) for m in re.finditer(r"measure_acceptance\.py --settings '[^']*'.*?--draft results/\S+/drafts/([\w.-]+)/final", out)}
    assert '"chat_template_kwargs": {"enable_thinking": false}' in commands["no-think"]
    assert '"chat_template_kwargs": {}' in commands["default"]
    # Its prompts render differently, so the run without speculation is its own: two baseline
    # jobs, each with its variant's template arguments, each read by that variant's acceptance.
    baselines = {m.group(2): m.group(1) for m in re.finditer(
        r"measure_baseline\.py --settings '([^']*)'.*?--out (results/\S+/verify/baseline/\w+\.json)", out)}
    assert len(baselines) == 2, out
    used = dict(re.findall(r"--draft results/\S+/drafts/([\w.-]+)/final.*?--baseline (\S+)", out))
    assert used["default"] != used["no-think"]
    assert json.loads(baselines[used["no-think"]])["chat_template_kwargs"] == {"enable_thinking": False}
    assert json.loads(baselines[used["default"]])["chat_template_kwargs"] == {}
