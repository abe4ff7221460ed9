"""The workflow as a whole: lint, config validation, dry-run job lists, the plan."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import PY, REPO, base_test_config, run_snakemake, with_defaults, write_config
from pipeline_lib.plan import format_plan, make_plan

EXPECTED_JOBS_TEST = {
    "target": 1, "prompts_train": 1, "prompts_eval": 1, "traces_shard": 2, "traces_gather": 1,
    "tokenize": 1, "hidden_states_shard": 2, "hidden_states_gather": 1, "train_draft": 1,
    "load_check": 1, "contract_checks": 1, "acceptance_baseline": 1, "acceptance": 1, "report": 1, "compare_variants": 1, "all": 1,
    "eval_suite": 1,  # the test config's one eval suite (verify.suites: code)
}


def planned_jobs(output: str) -> dict[str, int]:
    """Parse Snakemake's 'Job stats' table into {rule: count}."""
    stats = output.split("Job stats:", 1)
    if len(stats) < 2:
        return {}
    jobs = {}
    for line in stats[1].splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":
            jobs[m.group(1)] = int(m.group(2))
    return jobs


def planned_job_set(output: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every job of a dry-run's listing as (rule, sorted wildcard items): which rule, and for
    which variant, stage instance and shard."""
    jobs, rule, wildcards = set(), None, ()
    for line in output.splitlines() + ["rule end:"]:
        m = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if m:
            if rule is not None:
                jobs.add((rule, wildcards))
            rule, wildcards = m.group(1), ()
        elif rule is not None and line.strip().startswith("wildcards:"):
            items = (w.split("=", 1) for w in line.split(":", 1)[1].strip().split(", "))
            wildcards = tuple(sorted((k, v) for k, v in items))
    return jobs


def test_lint_is_clean():
    proc = subprocess.run([PY, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations, your workflow is in a good condition" in proc.stdout + proc.stderr


def test_dry_run_default_config_lists_every_stage(tmp_path):
    proc = subprocess.run([PY, "-m", "snakemake", "-n", "-d", str(tmp_path), "--cores", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    jobs = planned_jobs(proc.stdout + proc.stderr)
    demo = yaml.safe_load((REPO / "config.yaml").read_text())
    assert jobs["traces_shard"] == demo["generation"]["num_shards"]
    assert jobs["hidden_states_shard"] == demo["hidden_states"]["num_shards"]
    assert set(jobs) == set(EXPECTED_JOBS_TEST), jobs
    # The plan is printed before Snakemake's job list, with estimates, and nothing was written.
    assert "hidden states: <=" in proc.stderr and "GPU-hours" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_dry_run_test_config_lists_expected_jobs(tmp_path, test_config):
    proc = run_snakemake(tmp_path, test_config, "-n")
    assert planned_jobs(proc.stdout + proc.stderr) == EXPECTED_JOBS_TEST


def test_variants_add_only_their_own_jobs(tmp_path, test_config):
    test_config["variants"] = {"default": {}, "wide-vocab": {"draft_vocab_size": 1024}, "lr-high": {"lr": 0.01}}
    jobs = planned_jobs((p := run_snakemake(tmp_path, test_config, "-n")).stdout + p.stderr)
    for rule in ("train_draft", "load_check", "contract_checks", "acceptance", "report"):
        assert jobs[rule] == 3, (rule, jobs)
    # ... and the target without speculation is measured once, for all three (same verify settings).
    for rule in ("target", "traces_gather", "tokenize", "hidden_states_gather", "acceptance_baseline"):
        assert jobs[rule] == 1, (rule, jobs)


@pytest.mark.parametrize("change, expected", [
    ({"generation": {"max_tokenz": 10}}, "max_tokenz"),
    ({"generation": {"max_tokens": "many"}}, "max_tokens"),
    ({"train": {"optimizer": "sgd"}}, "optimizer"),
    ({"typo_section": {}}, "typo_section"),
])
def test_bad_config_names_the_key(tmp_path, test_config, change, expected):
    for section, value in change.items():
        if isinstance(test_config.get(section), dict):
            test_config[section].update(value)
        else:
            test_config[section] = value
    proc = run_snakemake(tmp_path, test_config, "-n", check=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert expected in err, err[-3000:]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("encoding", ["bom", "latin-1"])
def test_default_config_bytes(tmp_path, encoding):
    """config.yaml saved with a byte-order mark plans as usual; saved as Latin-1, the run stops
    naming config.yaml, the line and the byte offset (not a codec traceback from YAML)."""
    repo = tmp_path / "workflow"
    repo.mkdir()
    for name in ("Snakefile", "rules", "scripts", "schemas", "profiles"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, repo / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                          if (REPO / name).is_dir() else {}))
    text = (REPO / "config.yaml").read_bytes()
    first_comment = text.index(b"# ")
    if encoding == "bom":
        data = b"\xef\xbb\xbf" + text
    else:  # a Latin-1 'e acute' in the first comment
        data = text[:first_comment + 2] + b"caf\xe9 " + text[first_comment + 2:]
    (repo / "config.yaml").write_bytes(data)
    proc = subprocess.run([PY, "-m", "snakemake", "-s", str(repo / "Snakefile"), "-d", str(tmp_path / "w"),
                           "-n", "--cores", "2"], capture_output=True, text=True, timeout=120)
    if encoding == "bom":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert set(planned_jobs(proc.stdout + proc.stderr)) == set(EXPECTED_JOBS_TEST)
        return
    assert proc.returncode != 0
    line = text.count(b"\n", 0, first_comment) + 1
    offset = first_comment + 2 + 3
    out = proc.stdout + proc.stderr
    assert f"config.yaml:{line}: not UTF-8 text (byte(s) e9 at byte offset {offset}" in out, out[-3000:]
    assert "UnicodeDecodeError" not in out


def test_kimi_scale_plan_is_fast_and_right(tmp_path, test_config):
    """A 1T-parameter MoE target described by its config only (Kimi-K2.5 scale): 100k prompts,
    1000 trace shards. Planning must take seconds and the estimates must follow the formulas."""
    cfg = test_config
    cfg["run_name"] = "kimi-scale"
    cfg["target"] = {"source": "hub", "hub_id": "moonshotai/Kimi-K2.5", "revision": "0123456789abcdef"}
    cfg["prompts"]["train"] = {"source": "mlabonne/open-perfectblend", "format": "sharegpt", "num_samples": 100_000}
    cfg["generation"].update(num_shards=1000, max_tokens=2048)
    cfg["tokenize"]["max_seq_len"] = 4096
    cfg["hidden_states"].update(num_shards=1000, aux_layer_ids=[2, 30, 58])
    cfg["train"].update(draft_vocab_size=32000, keep_last=2)
    cfg["plan"] = {"target_shape": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
                                    "intermediate_size": 18432}, "avg_prompt_tokens": 256}
    cfg["resources"] = {"traces": {"gpu": 8, "mem_mb": 900000, "runtime": 600, "threads": 64},
                        "hidden_states": {"gpu": 8, "mem_mb": 900000, "runtime": 600, "threads": 64}}
    config_path = write_config(tmp_path, cfg)
    start = time.time()
    proc = run_snakemake(tmp_path, config_path, "-n", "--quiet", "rules")
    elapsed = time.time() - start
    assert elapsed < 60, f"planning took {elapsed:.1f}s"
    err = proc.stderr
    tokens = 100_000 * min(256 + 2048, 4096)
    assert f"<= {100_000 * 2048:,} generated tokens" in err
    assert f"<= {tokens:,} tokens x 57.3 KB/token" in err  # 4 layers x 7168 x 2 bytes
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert jobs["traces_shard"] == 1000 and jobs["hidden_states_shard"] == 1000
    assert "traces_shard           x1000  64 / 900000 / 600 / 8" in err
    # 100k x 2304 tokens x 57,344 B = 13.2 TB: more than this disk has, and the plan says so.
    assert "13.2 TB" in err and "DOES NOT FIT" in err
    # Each way to keep the hidden states, priced (test_kimi_scale_plan_prices_each_hidden_state_option).
    assert re.search(r"offline bf16 .* GPU-h .*<- configured", err) and re.search(r"offline fp8 .* GPU-h", err)
    assert re.search(r"online .* GPU-h", err)


def test_self_vs_dataset_ablation_config_shares_target_and_prompts_only(tmp_path):
    """configs/ablation-self-vs-dataset.yaml: two variants differing in
    generation.source. One target and one prompt set; each variant its own traces, tokenized
    data, hidden states and draft (the base in the plain directories, the dataset variant in
    <stage>-<digest> ones)."""
    proc = subprocess.run([PY, "-m", "snakemake", "-n", "-d", str(tmp_path), "--cores", "2", "--configfile",
                           str(REPO / "configs/ablation-self-vs-dataset.yaml")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_job_set(proc.stdout + proc.stderr)
    by_rule: dict[str, list[dict]] = {}
    for rule, wildcards in jobs:
        by_rule.setdefault(rule, []).append(dict(wildcards))
    for rule in ("target", "prompts_train", "prompts_eval", "compare_variants"):
        assert len(by_rule[rule]) == 1, (rule, by_rule[rule])
    instances = {stage: {w[stage] for w in by_rule[rule]} for stage, rule in
                 (("traces", "traces_gather"), ("tokenized", "tokenize"), ("hidden_states", "hidden_states_gather"))}
    for stage, dirs in instances.items():
        plain = {d for d in dirs if d == stage}
        digested = {d for d in dirs if re.fullmatch(rf"{stage}-[0-9a-f]{{10}}", d)}
        assert len(plain) == len(digested) == 1 and dirs == plain | digested, (stage, dirs)
    assert len(by_rule["traces_shard"]) == 4  # 2 shards per instance
    for rule in ("train_draft", "load_check", "contract_checks", "acceptance", "report"):
        assert sorted(w["variant"] for w in by_rule[rule]) == ["dataset-answers", "self-generated"], rule
    assert '"source": "dataset"' in proc.stdout and "answered_only" in proc.stdout
    assert not (tmp_path / "results").exists()


KIMI_SHAPE = {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840, "intermediate_size": 18432}


def kimi_config(tiny_target: Path, **hs) -> dict:
    """The Kimi-K2.5-scale run of test_kimi_scale_plan_is_fast_and_right, training on 8 GPUs."""
    cfg = base_test_config(tiny_target)
    cfg["prompts"]["train"]["num_samples"] = 100_000
    cfg["generation"].update(max_tokens=2048)
    cfg["tokenize"]["max_seq_len"] = 4096
    cfg["hidden_states"].update({"aux_layer_ids": [2, 30, 58], "dtype": "bfloat16", "mode": "offline",
                                 "storage": "bf16", "server_gpus": 2, **hs})
    cfg["train"].update(draft_vocab_size=32000, keep_last=2, epochs=10, num_workers=4)
    cfg["resources"] = {"train": {"gpu": 8}}
    # Measured throughputs (plan.throughput) replace the estimates from the model's size.
    cfg["plan"] = {"target_shape": KIMI_SHAPE, "avg_prompt_tokens": 256, "disk_free_bytes": 10 * 10**12,
                   "throughput": {"extraction_tokens_per_s": 40000.0, "train_tokens_per_s": 60000.0}}
    return with_defaults(cfg)


def test_kimi_scale_plan_prices_each_hidden_state_option(tiny_target, tmp_path):
    """230.4M training tokens x 4 layers x 7168: bf16 57,344 B/token (13.2 TB), fp8 28,676 B/token;
    on a 10 TB filesystem offline bf16 does not fit (2x margin), fp8 does not either, online does
    and costs the server's GPU time."""
    tokens = 100_000 * min(256 + 2048, 4096)
    plan = make_plan(kimi_config(tiny_target), tmp_path)
    opts = plan["hidden_state_options"]
    assert opts["offline bf16"]["hidden_state_bytes"] == tokens * 4 * 7168 * 2
    assert opts["offline fp8"]["hidden_state_bytes"] == tokens * (4 * 7168 + 4)
    assert opts["online"]["hidden_state_bytes"] == 0 and opts["online"]["disk_bytes"] == plan["checkpoint_bytes_total"]
    assert [name for name, o in opts.items() if o["fits"]] == ["online"] and not plan["fits_disk"]
    # Online, 8 GPUs = 2 server + 6 trainer; 10 epochs; overlapped (num_workers > 0):
    # max(train 2.304e9/60000/3600/6, extract 2.304e9/40000/3600/2) = 8.0 h on 8 GPUs = 64 GPU-h.
    assert opts["online"]["gpu_hours_train"] == pytest.approx(64.0, abs=0.01)
    assert opts["offline bf16"]["gpu_hours_train"] == pytest.approx(tokens * 10 / 60000 / 3600, abs=0.01)
    text = format_plan(plan)
    assert "what fits instead: online (hidden_states: {mode: online, storage: bf16 or fp8})" in text
    assert f"{opts['online']['gpu_hours_total'] - opts['offline bf16']['gpu_hours_total']:+.1f} vs offline bf16" in text

    # With 20 TB free, fp8 (2 x 6.6 TB + checkpoints) fits at no extra GPU time.
    cfg = kimi_config(tiny_target)
    cfg["plan"]["disk_free_bytes"] = 20 * 10**12
    text = format_plan(make_plan(cfg, tmp_path))
    assert "what fits instead: offline fp8" in text and "(+0.0 vs offline bf16)" in text

    # Configured online: no hidden-state jobs, nothing on disk, the online GPU-hours.
    plan = make_plan(kimi_config(tiny_target, mode="online"), tmp_path)
    assert plan["jobs"]["hidden_states_shard"] == 0 and plan["hidden_state_bytes"] == 0 and plan["fits_disk"]
    assert plan["gpu_hours"]["train"] == pytest.approx(64.0, abs=0.01) and plan["gpu_hours"]["hidden_states"] == 0
    assert "nothing on disk" in format_plan(plan)


def test_plan_counts_the_built_prompts_when_a_mix_entry_has_no_cap(tiny_target, tmp_path):
    """A mix entry without num_samples takes its whole source: the first plan cannot size it and
    says so; once prompts_train has run, the plan takes the count its provenance records."""
    cfg = base_test_config(tiny_target)
    cfg["prompts"]["train"]["num_samples"] = None
    cfg = with_defaults(cfg)
    plan = make_plan(cfg, tmp_path)
    assert plan["prompts"] == 0 and any("num_samples is null" in n for n in plan["notes"])
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.provenance.json").write_text('{"rule": "prompts_train", "counts": {"written": 3}}')
    plan = make_plan(cfg, tmp_path)
    assert plan["prompts"] == 3 and any("counted in" in n for n in plan["notes"])
    assert "traces: 3 prompts" in format_plan(plan)


def test_online_mode_dag_has_no_hidden_state_jobs(tiny_target, tmp_path):
    cfg = base_test_config(tiny_target)
    cfg["hidden_states"].update(mode="online", storage="fp8")
    proc = run_snakemake(tmp_path, cfg, "-n")
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert "hidden_states_shard" not in jobs and "hidden_states_gather" not in jobs
    assert jobs["train_draft"] == 1 and jobs["contract_checks"] == 1
    assert "hidden states: online" in proc.stderr


def test_variants_may_train_online_or_on_fp8_files(tiny_target, tmp_path):
    """mode and storage are hidden_states keys a variant may set: an fp8 variant gets its own
    hidden-states instance (its shard writes fp8), an online one none, and its train job gets the
    tokenized data and its own server settings while the base trains offline."""
    cfg = base_test_config(tiny_target)
    cfg["variants"] = {"default": {}, "online": {"hidden_states": {"mode": "online"}},
                       "fp8": {"hidden_states": {"storage": "fp8"}}}
    proc = run_snakemake(tmp_path, cfg, "-n")
    out = proc.stdout + proc.stderr
    shards = {dict(w)["hidden_states"] for rule, w in planned_job_set(out) if rule == "hidden_states_shard"}
    fp8_dir = next(d for d in shards if d != "hidden_states")
    assert shards == {"hidden_states", fp8_dir} and re.fullmatch(r"hidden_states-[0-9a-f]{10}", fp8_dir)
    commands = [line for line in out.splitlines() if "train_draft.py" in line or "extract_hidden_states.py" in line]

    def command(*needles):
        found = [c for c in commands if all(n in c for n in needles)]
        assert found, needles
        return found

    r = f"results/{cfg['run_name']}"
    assert all('"storage": "fp8"' in c for c in command("extract_hidden_states.py", f"{r}/{fp8_dir}/store"))
    assert all('"storage": "bf16"' in c for c in command("extract_hidden_states.py", f"{r}/hidden_states/store"))
    (online,) = command("train_draft.py", "drafts/online/")
    assert '"mode": "online"' in online and f"--data {r}/tokenized/data --token-freq" in online
    assert "--hs-manifest" not in online
    (fp8,) = command("train_draft.py", "drafts/fp8/")
    assert f"--hs-manifest {r}/{fp8_dir}/manifest.json" in fp8
    (base,) = command("train_draft.py", "drafts/default/")
    assert '{"mode": "offline"}' in base and f"--hs-manifest {r}/hidden_states/manifest.json" in base


def test_resources_default_fills_what_a_stage_leaves_out(tmp_path, test_config):
    """resources.default applies to every stage for the keys the stage's own section does not
    set; the schema's defaults apply only where neither does. The dry-run plan shows what each
    rule's jobs get."""
    cfg = test_config
    cfg["resources"] = {"default": {"threads": 1, "mem_mb": 1234, "runtime": 7, "cpus_per_gpu": 4},
                        "traces": {"mem_mb": 999}, "train": {"threads": 3}}
    proc = run_snakemake(tmp_path, cfg, "-n", "--quiet", "rules")
    err = proc.stderr
    assert re.search(r"traces_shard\s+x2\s+1 / 999 / 7 / 0", err), err[-3000:]
    assert re.search(r"hidden_states_shard\s+x2\s+1 / 1234 / 7 / 0", err), err[-3000:]
    assert re.search(r"train_draft\s+x1\s+3 / 1234 / 7 / 0", err), err[-3000:]
    # Threads follow the GPUs (cpus_per_gpu) where the stage names none; Snakemake's own jobs
    # (what the SLURM plugin submits as --cpus-per-task) get them.
    cfg["resources"]["traces"]["gpu"] = 2
    cfg["resources"]["train"]["gpu"] = 2
    out = run_snakemake(tmp_path, cfg, "-n", "--cores", "16").stdout  # locally threads are capped at --cores
    threads = {rule: set(re.findall(r"threads: (\d+)", job)) for rule, job in re.findall(r"rule (\w+):\n(.*?)\n\n", out, re.S)}
    assert threads["traces_shard"] == {"8"} and threads["train_draft"] == {"3"}, out[-3000:]


# The demo overlays the README and docs name: the variants each plans, sharing one instance of
# every upstream stage (train-only variants) or, for a prompt-source ablation, one draft.
DEMO_OVERLAYS = {"demo-draft-types.yaml": ["default", "dflash", "peagle"],
                 "demo-levers.yaml": ["default", "epochs-8", "muon", "ttt-5"],
                 "demo-sharegpt.yaml": ["default"], "demo-synthesized.yaml": ["default"]}


def test_demo_overlays_plan_on_the_demo_config(tmp_path):
    assert sorted(p.name for p in (REPO / "configs").glob("demo-*.yaml")) == sorted(DEMO_OVERLAYS)
    for name, variants in DEMO_OVERLAYS.items():
        proc = subprocess.run([PY, "-m", "snakemake", "-n", "-d", str(tmp_path / name), "--cores", "2", "--configfile",
                               str(REPO / "config.yaml"), str(REPO / "configs" / name)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        by_rule: dict[str, list[dict]] = {}
        for rule, wildcards in planned_job_set(proc.stdout + proc.stderr):
            by_rule.setdefault(rule, []).append(dict(wildcards))
        assert sorted(w["variant"] for w in by_rule["acceptance"]) == variants, name
        assert len(by_rule["traces_gather"]) == len(by_rule["hidden_states_gather"]) == 1, name
    assert "synthesize_gather" in proc.stdout + proc.stderr  # the last: demo-synthesized.yaml
