"""profiles/slurm against a REAL single-node SLURM cluster (tests/slurm_cluster.py).

Every job goes through sbatch/srun; of the shipped profile only the partition/account
placeholders and the first status-check delay are replaced (and the plugin's growing wait
between status checks is capped at a few seconds: tests/slurm_snakemake.py), and the vLLM stages ask for one of the
cluster's two `vllm` licenses, so SLURM runs at most two at a time (a 2-core machine takes two
one-thread vLLM engines; with two OpenMP threads each they spin against each other). The cluster has accounting (slurmdbd), so the pipeline's runs use
the profile's `sacct` status command, the plugin's default; the throwaway workflow and the
preemption use `squeue`, the profile's documented choice without slurmdbd.

The whole chain goes through SLURM in two halves that run at the same time, next to two more
runs (each mostly waits on SLURM's status polls and its jobs' start-up):
  - upstream: target, prompts, eval suite, trace shards (gather), tokenize (`--until`);
  - downstream: hidden-state shards (gather), training, load check, contract checks,
    acceptance, report, in a working directory seeded with the e2e run's copies of what the
    upstream half makes. Both halves' artifacts must equal the e2e run's bytes, so the
    downstream half's inputs are exactly what the upstream half made through SLURM;
  - a throwaway workflow whose jobs ask for gpu=1 / gpu=2, run through SLURM (squeue);
  - a preemption: a second draft variant trains for many epochs in its own working directory
    seeded with a copy of the e2e run's results (only train_draft runs, through SLURM), its
    SLURM job is cancelled with `scancel` after some epochs, the rerun resumes after the last
    saved epoch.
The local reference is the session's e2e run (conftest.e2e): the same Snakefile and config,
profiles/default. The cluster needs root and SLURM installed: elsewhere these tests are skipped
and named, with their count and `sudo make test-root`, at the end of `make test`; in CI
(ROOT_TESTS=require) a missing SLURM or root fails them (tests/conftest.py: needs_root)."""
from __future__ import annotations

import copy
import itertools
import json
import re
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PY, REPO, write_config
from pipeline_lib.digests import path_digest
from pipeline_lib import dtypes  # noqa: E402
from slurm_cluster import (GPU_PARTITION, NUM_GPUS, PARTITION, BoundedRun, make_test_profile, run,  # noqa: F401
                           slurm_cluster)

RUN_TIMEOUT_S = 900
# The only rules that may run on the submitting host: the `localrules` of rules/common.smk.
LOCAL_RULES = {"all", "traces_gather", "hidden_states_gather", "compare_variants", "plan"}
# The pipeline's GPU stages (the rules run through scripts/run_on_gpus.py) and the GPUs the
# SLURM run gives them; training stays on the CPU here (train_draft.py refuses --gpus without
# a CUDA device, and SLURM's fake GPUs are /dev/null clones).
GPU_RULES = {"traces_shard", "hidden_states_shard", "load_check", "acceptance_baseline", "acceptance"}
GPU_RESOURCES = {"traces": {"gpu": 1}, "hidden_states": {"gpu": 1}, "verify": {"gpu": 1}}
# CPUs as a user's config gives them: a GPU stage's threads from cpus_per_gpu (pipeline_lib/
# resources.py), the CPU rules' from the default's threads. They differ, so sacct's AllocCPUS
# tells the two apart; one thread a GPU job keeps the vLLM stages' OpenMP threads as the local
# run's (their bytes are compared), the default's 2 reach only target and tokenize.
DEFAULT_RESOURCES = {"threads": 2, "cpus_per_gpu": 1}
# The chain's two halves: the rules the upstream run sends to SLURM (up to --until), and the
# results/<run>/ folders they make, which seed the downstream run.
UPSTREAM_RULES = {"target", "prompts_train", "prompts_eval", "eval_suite", "traces_shard", "tokenize"}
UPSTREAM_UNTIL = ["tokenize", "eval_suite", "prompts_eval"]
UPSTREAM_DIRS = {"target", "prompts", "eval_suites", "traces", "tokenized"}
ALL_SUBMITTED_RULES = UPSTREAM_RULES | {"hidden_states_shard", "train_draft", "load_check", "contract_checks",
                                        "acceptance_baseline", "acceptance", "report"}
# Artifacts whose bytes depend only on their inputs: equal in the SLURM run and the local one.
DETERMINISTIC = ["target/model", "target/manifest.json", "prompts/train.jsonl", "prompts/eval.jsonl",
                 "traces/traces.jsonl", "tokenized/data", "tokenized/token_freq.pt", "tokenized/stats.json",
                 "hidden_states/data", "hidden_states/manifest.json", "drafts/default/final",
                 "drafts/default/untrained"]
# The preemption: a variant long enough to be cancelled mid-training (an epoch takes ~0.5 s
# alone on a 2-core machine, ~1 s next to the pipeline's jobs).
PREEMPT_VARIANT, PREEMPT_EPOCHS, CANCEL_AFTER_EPOCH = "preempt", 16, 2
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")


def submitted_jobs(log: str) -> dict[str, str]:
    """{SLURM job id: path of SLURM's log for it} from Snakemake's output."""
    return {slurm_id: path for _, slurm_id, path in SUBMITTED.findall(log)}


def rules_run(log: str) -> tuple[list[str], list[str]]:
    """(rules Snakemake handed to the executor, rules it ran on this host), one entry per job."""
    remote = re.findall(r"^rule (\w+):$", log, flags=re.MULTILINE)
    local = re.findall(r"^localrule (\w+):$", log, flags=re.MULTILINE)
    return remote, local


# --- the runs -------------------------------------------------------------------------

RECORDER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    out, sleep = sys.argv[1], float(sys.argv[2])
    start = time.time()
    time.sleep(sleep)
    job = os.environ.get("SLURM_JOB_ID")
    shown = subprocess.run(["scontrol", "-d", "show", "job", job], capture_output=True, text=True,
                           timeout=30).stdout if job else ""
    env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_GPUS",
                                          "SLURM_GPUS_ON_NODE", "SLURM_JOB_PARTITION")}
    json.dump({"env": env, "start": start, "end": time.time(), "scontrol": shown}, open(out, "w"))
""")

GPU_SNAKEFILE = textwrap.dedent("""
    # Throwaway workflow: two one-GPU jobs and a two-GPU job, each recording what SLURM gave it.
    WRAP = {wrapper!r}
    REC = {recorder!r}

    rule all:
        input: "out/gpu1_0.json", "out/gpu1_1.json", "out/gpu2.json"

    rule gpu_one:
        output: "out/gpu1_{{i}}.json"
        log: "logs/gpu1_{{i}}.log"
        resources: gpu=1, mem_mb=200, runtime=5
        shell: "python {{WRAP}} --gpus {{resources.gpu}} -- python {{REC}} {{output}} 6 2> {{log}}"

    rule gpu_two:
        output: "out/gpu2.json"
        log: "logs/gpu2.log"
        resources: gpu=2, mem_mb=200, runtime=5
        shell: "python {{WRAP}} --gpus {{resources.gpu}} -- python {{REC}} {{output}} 6 2> {{log}}"
""")


@dataclass
class Runs:
    gpu_dir: Path
    gpu: BoundedRun
    upstream: BoundedRun
    upstream_results: Path
    slurm_dir: Path
    slurm_config: Path
    profile: Path
    pipeline: BoundedRun      # the downstream half
    results: Path
    local_results: Path
    preempt_results: Path
    preempted: BoundedRun
    resumed: BoundedRun
    cancelled_job: str
    cancelled_after_epoch: int


def snakemake_command(snakefile: Path, workdir: Path, *args: str) -> list[str]:
    # Snakemake's CLI with the plugin's status-poll back-off capped (tests/slurm_snakemake.py).
    return [PY, str(Path(__file__).with_name("slurm_snakemake.py")), "-s", str(snakefile), "-d", str(workdir), *args]


class Preemption:
    """Train a long variant through SLURM, scancel its job once CANCEL_AFTER_EPOCH is saved,
    then rerun the same command. Runs beside the pipeline: `poll()` advances it a step."""

    def __init__(self, workdir: Path, profile: Path, config: dict, root: Path, seed_from: Path):
        cfg = copy.deepcopy(config)
        cfg["variants"][PREEMPT_VARIANT] = {"epochs": PREEMPT_EPOCHS}
        # Its training inputs (target, hidden states) and everything upstream: copies of the
        # e2e run's, mtimes kept, so Snakemake finds them up to date and runs train_draft only.
        shutil.copytree(seed_from, workdir / "results" / cfg["run_name"], copy_function=shutil.copy2,
                        ignore=shutil.ignore_patterns("drafts"))
        configfile = write_config(workdir, cfg)
        self.results = workdir / "results" / cfg["run_name"]
        self.checkpoints = self.results / "drafts" / PREEMPT_VARIANT / "checkpoints"
        self.cmd = snakemake_command(REPO / "Snakefile", workdir, "--configfile", str(configfile),
                                     "--workflow-profile", str(profile),
                                     f"results/{cfg['run_name']}/drafts/{PREEMPT_VARIANT}/final")
        self.root = root
        self.first = BoundedRun(self.cmd, root / "preempt-1.log", RUN_TIMEOUT_S)
        self.second: BoundedRun | None = None
        self.job: str | None = None     # the cancelled SLURM job
        self.saved: int | None = None   # the last complete epoch when it was cancelled
        self.cancel_by = time.monotonic() + 420

    def poll(self) -> bool:
        """True once the rerun has finished; raises if a step never happened."""
        if self.job is None:
            self.job = next((sid for _, sid, log in SUBMITTED.findall(self.first.output)
                             if "rule_train_draft" in log), None)
        if self.saved is None:
            # An epoch is complete once saved AND validated (train_draft.py's rule: speculators
            # saves before it validates), so wait for its validation row in the metrics log.
            if self.job is not None and CANCEL_AFTER_EPOCH in complete_epochs(self.checkpoints):
                run(["scancel", self.job])
                self.saved = max(complete_epochs(self.checkpoints))
            elif self.first.poll() or time.monotonic() > self.cancel_by:
                self.first.interrupt()
                raise AssertionError(f"no scancel: job {self.job} did not reach epoch {CANCEL_AFTER_EPOCH} before "
                                     f"the run ended or 420 s passed:\n{self.first.output[-6000:]}")
            return False
        if not self.first.poll():
            if time.monotonic() > self.first.deadline:
                self.first.wait()  # interrupts it
            return False
        if self.second is None:
            self.second = BoundedRun(self.cmd, self.root / "preempt-2.log", RUN_TIMEOUT_S)
        if not self.second.poll() and time.monotonic() > self.second.deadline:
            self.second.wait()
        return self.second.poll()

    def interrupt(self) -> None:
        for r in (self.first, self.second):
            if r is not None:
                r.interrupt()


def complete_epochs(ckpt: Path) -> set[int]:
    """Epochs with a saved checkpoint and a validation row in the metrics log."""
    validated = set()
    log = ckpt / "metrics.jsonl"
    for line in (log.read_text().splitlines() if log.exists() else []):
        try:
            row = json.loads(line)
        except ValueError:  # the line being appended right now
            continue
        if row.get("split") == "val":
            validated.add(row["epoch"])
    return {e for e in validated if (ckpt / str(e) / "training_state.json").exists()}


@pytest.fixture(scope="module")
def runs(slurm_cluster, e2e, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-runs")
    # squeue: the documented choice without slurmdbd, kept covered by the throwaway workflow,
    # and needed by the preemption: sacct calls a cancelled job "CANCELLED by <uid>", which
    # the plugin (2.8.0) does not count as failed, so that run would wait forever.
    squeue_profile = make_test_profile(REPO / "profiles" / "slurm", root / "profile-squeue",
                                       **{"slurm-status-command": "squeue"})
    # The status command stays the shipped sacct; vLLM jobs queue for the licenses.
    profile = make_test_profile(REPO / "profiles" / "slurm", root / "profile", licensed=tuple(GPU_RULES))

    gpu_dir = root / "gpu-wf"
    gpu_dir.mkdir()
    (gpu_dir / "recorder.py").write_text(RECORDER)
    (gpu_dir / "Snakefile").write_text(GPU_SNAKEFILE.format(wrapper=str(REPO / "scripts" / "run_on_gpus.py"),
                                                            recorder=str(gpu_dir / "recorder.py")))
    config = copy.deepcopy(e2e.config)
    # The e2e run's one thread per stage, except: a GPU for each GPU stage, with its CPUs from
    # cpus_per_gpu (its own threads dropped), and the default's CPUs (DEFAULT_RESOURCES).
    config["resources"] = {stage: {**config["resources"].get(stage, {}), **GPU_RESOURCES.get(stage, {})}
                           for stage in config["resources"].keys() | GPU_RESOURCES.keys()}
    for stage in GPU_RESOURCES:
        config["resources"][stage].pop("threads", None)
    config["resources"]["default"] = {**config["resources"].get("default", {}), **DEFAULT_RESOURCES}
    # Those "GPU" stages run on this machine's CPUs: pin each dtype to what the local run resolved
    # (auto would give a stage that asks for a GPU bfloat16), so that both runs compute alike.
    for section, entry in dtypes.resolution(copy.deepcopy(e2e.config)).items():
        if section != "cpu" and entry.get("dtype"):
            config[section] = {**config[section], "dtype": entry["dtype"]}
    # Its acceptance is compared with the local run's (acceptance, spans, verdict), never its
    # speed: no speedup rounds, whose two engines would double the acceptance job.
    config["verify"] = {**config["verify"], "speedup_rounds": 0}
    upstream_dir = root / "pipeline-upstream"
    upstream_cfg = write_config(upstream_dir, config)
    slurm_dir = root / "pipeline-slurm"
    slurm_cfg = write_config(slurm_dir, config)
    # Copies keep their mtimes, so Snakemake finds them up to date and runs the rest.
    for sub in UPSTREAM_DIRS:
        shutil.copytree(e2e.results / sub, slurm_dir / "results" / config["run_name"] / sub,
                        copy_function=shutil.copy2)

    started_at = time.monotonic()
    started = [
        # --verbose: the plugin then logs which command each status check used.
        gpu := BoundedRun(snakemake_command(gpu_dir / "Snakefile", gpu_dir, "--workflow-profile", str(squeue_profile),
                                            "--verbose"),
                          root / "gpu-wf.log", RUN_TIMEOUT_S),
        upstream := BoundedRun(snakemake_command(REPO / "Snakefile", upstream_dir, "--configfile", str(upstream_cfg),
                                                 "--workflow-profile", str(profile), "--verbose",
                                                 "--until", *UPSTREAM_UNTIL),
                               root / "pipeline-upstream.log", RUN_TIMEOUT_S),
        pipeline := BoundedRun(snakemake_command(REPO / "Snakefile", slurm_dir, "--configfile", str(slurm_cfg),
                                                 "--workflow-profile", str(profile), "--verbose"),
                               root / "pipeline-slurm.log", RUN_TIMEOUT_S),
    ]
    preemption = None
    try:
        preemption = Preemption(root / "preempt-slurm", squeue_profile, config, root, e2e.results)
        # Both evaluated every round: the preemption advances while the runs go on.
        while not all([preemption.poll(), *[r.poll() for r in started]]):
            for r in started:
                if not r.poll() and time.monotonic() > r.deadline:
                    r.wait()  # interrupts it
            time.sleep(0.1)
        upstream.check()
        pipeline.check()
        yield Runs(gpu_dir, gpu, upstream, upstream_dir / "results" / config["run_name"],
                   slurm_dir, slurm_cfg, profile, pipeline, slurm_dir / "results" / config["run_name"], e2e.results,
                   preemption.results, preemption.first, preemption.second, preemption.job, preemption.saved)
    finally:
        for r in started:  # when a wait was cut short: nothing keeps running
            r.interrupt()
        if preemption is not None:
            preemption.interrupt()
        walls = {"cluster start": slurm_cluster.start_s, "GPU workflow": gpu.wall_s, "upstream": upstream.wall_s,
                 "downstream": pipeline.wall_s,
                 "preempted run": preemption and preemption.first.wall_s,
                 "resumed run": preemption and preemption.second and preemption.second.wall_s,
                 "all side by side": time.monotonic() - started_at}
        (root / "timings.json").write_text(json.dumps(walls, indent=1))
        print("\nSLURM test wall times (s): " + ", ".join(f"{k} {v:.1f}" if v is not None else f"{k} -"
                                                          for k, v in walls.items()), file=sys.stderr)


def test_every_job_goes_through_sbatch_and_its_slurm_log_is_kept(runs):
    upstream, _ = rules_run(runs.upstream.check())
    downstream, _ = rules_run(runs.pipeline.check())
    # The whole chain, every stage, each in one of the halves (the downstream one redid none of
    # the upstream's): nothing but the localrules ran outside SLURM.
    assert set(upstream) == UPSTREAM_RULES, upstream
    assert set(downstream) == ALL_SUBMITTED_RULES - UPSTREAM_RULES, downstream
    for run_, expected_remote in ((runs.gpu, 3), (runs.upstream, None), (runs.pipeline, None), (runs.resumed, 1)):
        log = run_.check()
        remote, local = rules_run(log)
        submitted = submitted_jobs(log)
        assert remote, f"no job was handed to SLURM:\n{log[-4000:]}"
        if expected_remote is not None:
            assert len(remote) == expected_remote, remote
        assert len(submitted) == len(remote), f"jobs of rules {remote}, sbatch submissions {sorted(submitted)}"
        assert set(local) <= LOCAL_RULES, f"rules {local} ran on the submitting host, not through SLURM"
        for path in submitted.values():
            assert Path(path).exists(), f"SLURM's log {path} of a successful job was not kept"


def devices_of(record: dict) -> set[str]:
    return set(record["env"]["CUDA_VISIBLE_DEVICES"].split(","))


def test_gpu_jobs_receive_their_gres_from_slurm(runs):
    submitted = submitted_jobs(runs.gpu.check())
    records = {p.stem: json.loads(p.read_text()) for p in (runs.gpu_dir / "out").glob("*.json")}
    assert sorted(records) == ["gpu1_0", "gpu1_1", "gpu2"]
    for name, record in records.items():
        env, wanted = record["env"], 2 if name == "gpu2" else 1
        assert env["SLURM_JOB_ID"] in submitted, f"{name} ran outside the jobs Snakemake submitted"
        assert env["SLURM_JOB_PARTITION"] == PARTITION
        # SLURM (not the wrapper's local locks) chose the devices: they are the job's gres.
        devices = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(devices) == wanted and set(devices) <= {str(i) for i in range(NUM_GPUS)}, env
        assert env["CUDA_VISIBLE_DEVICES"] == env["SLURM_JOB_GPUS"], env
        assert re.search(rf"^\s*JOB_GRES=gpu:{wanted}$", record["scontrol"], flags=re.MULTILINE), record["scontrol"]
        assert f"TresPerJob=gres:gpu:{wanted}" in record["scontrol"], "the job was not submitted with --gpus"
        wrapper_log = (runs.gpu_dir / "logs" / f"{name}.log").read_text()
        assert f"SLURM job {env['SLURM_JOB_ID']} gave CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" \
            in wrapper_log
    assert not (runs.gpu_dir / ".snakemake" / "gpu-locks").exists(), "under SLURM no local locks are taken"
    overlaps = 0
    for (a, ra), (b, rb) in itertools.combinations(records.items(), 2):
        if ra["start"] < rb["end"] and rb["start"] < ra["end"]:
            overlaps += 1
            shared = devices_of(ra) & devices_of(rb)
            assert not shared, f"{a} and {b} ran at once on GPU {shared}"
    print(f"\nGPU jobs running at the same time (pairs): {overlaps}", file=sys.stderr)
    # Jobs that never overlapped would make the check above vacuous: the three were submitted
    # together, each holding its GPUs for 6 s, on a node with GPUs for all of them.
    assert overlaps >= 1, {k: (r["start"], r["end"]) for k, r in records.items()}


def slurm_job_rules(log: str) -> dict[str, str]:
    """{SLURM job id: rule} from Snakemake's output (SLURM's log path names the rule)."""
    return {sid: re.search(r"rule_(\w+?)/", path).group(1) for sid, path in submitted_jobs(log).items()}


def test_pipeline_gpu_rules_ask_for_and_receive_gres(runs):
    jobs = slurm_job_rules(runs.upstream.check()) | slurm_job_rules(runs.pipeline.check())
    rule_logs = "\n".join(p.read_text(errors="replace") for results in (runs.upstream_results, runs.results)
                          for p in (results / "logs").rglob("*.log"))
    gpu_jobs = 0
    for sid, rule in jobs.items():
        shown = run(["scontrol", "-d", "show", "job", sid]).stdout
        if rule in GPU_RULES:
            gpu_jobs += 1
            assert "TresPerJob=gres:gpu:1" in shown, f"{rule} (job {sid}) was not submitted with --gpus=1:\n{shown}"
            assert "Licenses=vllm" in shown, f"{rule} (job {sid}) did not queue for the vLLM license:\n{shown}"
            # The job's GPU wrapper saw the device SLURM allocated (not a local lock's choice).
            assert re.search(rf"SLURM job {sid} gave CUDA_VISIBLE_DEVICES=[0-{NUM_GPUS - 1}] \(1 GPU", rule_logs), \
                f"{rule} (job {sid}): no gres reached the job"
        else:
            assert "gres:gpu" not in shown, f"CPU rule {rule} (job {sid}) asked for a GPU:\n{shown}"
    assert gpu_jobs == 7  # 2 trace shards, 2 hidden-state shards, load check, acceptance baseline, acceptance


def test_pipeline_jobs_ran_inside_slurm_jobs(runs):
    # provenance.json records SLURM_JOB_ID (pipeline_lib.provenance.ENV_ALLOW_LIST): every
    # artifact of a submitted rule names one of the jobs its run submitted; localrules' name
    # none. (The downstream half's seeded copies are the e2e run's; the preempted variant's
    # record is checked by the preemption test.)
    made = [(path, slurm_job_rules(runs.upstream.check())) for path in runs.upstream_results.rglob("*provenance.json")]
    made += [(path, slurm_job_rules(runs.pipeline.check())) for path in runs.results.rglob("*provenance.json")
             if path.relative_to(runs.results).parts[0] not in UPSTREAM_DIRS]
    rules = sorted(json.loads(path.read_text())["rule"] for path, _ in made)
    assert rules == sorted(["target", "prompts_train", "prompts_eval", "eval_suite", "traces_gather", "tokenize",
                            "hidden_states_gather", "train_draft", "contract_checks", "acceptance_baseline",
                            "acceptance", "report"]), rules
    for path, submitted in made:
        record = json.loads(path.read_text())
        job = record.get("env", {}).get("SLURM_JOB_ID")
        if record["rule"] in LOCAL_RULES:
            assert job is None, f"{path}: localrule {record['rule']} ran inside SLURM job {job}"
        else:
            # Its own job: the one Snakemake submitted for this rule (a gather is a localrule).
            assert submitted.get(job) == record["rule"], \
                f"{path}: rule {record['rule']} ran in SLURM job {job}; submitted (job: rule): {submitted}"


def test_the_chain_through_slurm_matches_the_local_run(runs):
    for rel in DETERMINISTIC:
        made_by = runs.upstream_results if rel.split("/")[0] in UPSTREAM_DIRS else runs.results
        assert path_digest(made_by / rel) == path_digest(runs.local_results / rel), \
            f"{rel} differs between the SLURM run ({made_by}) and the local run"
    # Acceptance and the verdict too (vLLM greedy in fp32); only timings may differ.
    ours, theirs = (json.loads((r / "drafts/default/report/verification.json").read_text())
                    for r in (runs.results, runs.local_results))
    assert ours["verdict"] == theirs["verdict"] and ours["verdict"]["passed"] is True
    assert ours["acceptance"]["acceptance"] == theirs["acceptance"]["acceptance"]
    assert ours["acceptance"]["spans"] == theirs["acceptance"]["spans"]
    assert ours["provenance"]["chain"]["intact"] is True
    assert json.loads((runs.results / "drafts/default/load_check.json").read_text())["ok"] is True


def test_a_cancelled_training_job_resumes_when_rerun(runs):
    """scancel hit train_draft's SLURM job after epoch CANCEL_AFTER_EPOCH was saved: that run
    failed, the rerun resumed after the last saved epoch instead of starting over."""
    assert runs.preempted.returncode not in (0, None), runs.preempted.output[-4000:]
    first_jobs = slurm_job_rules(runs.preempted.output)
    assert first_jobs.get(runs.cancelled_job) == "train_draft"
    assert f"{runs.cancelled_job}" in runs.preempted.output and "train_draft" in runs.preempted.output
    # Seeded with the e2e run's upstream: nothing but this training went to SLURM.
    assert list(first_jobs.values()) == ["train_draft"], first_jobs
    runs.resumed.check()
    [resumed_job] = slurm_job_rules(runs.resumed.output)
    assert resumed_job != runs.cancelled_job
    variant = runs.preempt_results / "drafts" / PREEMPT_VARIANT
    prov = json.loads((variant / "provenance.json").read_text())
    resumed_after = prov["resumed_after_epoch"]
    # Cancelled once epoch CANCEL_AFTER_EPOCH was saved (a later one may have been saved while
    # the signal was on its way), well before the last epoch.
    assert runs.cancelled_after_epoch <= resumed_after < PREEMPT_EPOCHS - 1
    assert prov["env"]["SLURM_JOB_ID"] == resumed_job
    log = (runs.preempt_results / "logs/train" / f"{PREEMPT_VARIANT}.log").read_text()
    assert f"resuming after epoch {resumed_after}" in log
    assert f"Training epoch {resumed_after + 1}/{PREEMPT_EPOCHS} started" not in log  # not trained again
    # Epochs up to the resume point were trained (and logged) by the cancelled job only, the
    # rest by the rerun only; no epoch twice.
    rows = [json.loads(line) for line in (variant / "checkpoints/metrics.jsonl").read_text().splitlines()]
    keys = [(r["epoch"], r["split"]) for r in rows]
    assert len(keys) == len(set(keys))
    first, second = rows[0]["run_started"], rows[-1]["run_started"]
    assert first != second
    assert all(r["run_started"] == (first if r["epoch"] <= resumed_after else second) for r in rows)
    assert {(e, s) for e in range(resumed_after + 1, PREEMPT_EPOCHS) for s in ("train", "val")} <= set(keys)
    assert (variant / "final/config.json").exists()


STATUS_CYCLE = re.compile(r"Status query timing \(cycle\): command=(\w+),")


def sacct_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (job name, state)} as SLURM's accounting (sacct, through slurmdbd) has them."""
    out = run(["sacct", "-X", "--parsable2", "--noheader", "--format=JobIdRaw,JobName,State",
               "-j", ",".join(job_ids)]).stdout
    return {jid: (name, state) for jid, name, state in (line.split("|") for line in out.splitlines())}


def test_the_pipeline_polled_sacct_and_accounting_has_every_job(runs):
    """The shipped profile's status command, sacct, is what the pipeline run polled with, and
    slurmdbd's records (what sacct answered) show each of its jobs COMPLETED, all under the
    one job name the plugin gives a run and filters its sacct query on."""
    names = set()
    for half in (runs.upstream, runs.pipeline):
        log = half.check()
        assert set(STATUS_CYCLE.findall(log)) == {"sacct"}, "the pipeline's status checks did not all use sacct"
        jobs = submitted_jobs(log)
        states = sacct_states(list(jobs))
        assert sorted(states) == sorted(jobs), f"sacct knows {sorted(states)} of the submitted jobs {sorted(jobs)}"
        assert {state for _, state in states.values()} == {"COMPLETED"}, states
        [name] = {name for name, _ in states.values()}
        names.add(name)
    assert len(names) == 2, names  # one per run: the plugin's sacct query tells the runs apart
    # The squeue path (no slurmdbd) stays covered: the throwaway workflow's checks used squeue.
    assert set(STATUS_CYCLE.findall(runs.gpu.check())) == {"squeue"}


def rule_resources(configfile: Path = REPO / "config.yaml", workdir: Path = REPO) -> dict[str, dict]:
    """{rule: {"threads": N, "gpu": N (rules that declare one)}} as Snakemake itself parses the
    workflow with this config: what each rule's jobs ask for before any profile applies."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings, StorageSettings

    with SnakemakeApi(OutputSettings()) as api:
        workflow = api.workflow(resource_settings=ResourceSettings(), storage_settings=StorageSettings(),
                                config_settings=ConfigSettings(configfiles=[configfile]),
                                snakefile=REPO / "Snakefile", workdir=workdir)
        return {rule.name: {"threads": rule.resources["_cores"].value,
                            **({"gpu": rule.resources["gpu"].value} if "gpu" in rule.resources else {})}
                for rule in workflow._workflow.rules}


def gpu_rules() -> set[str]:
    """The rules that declare a `gpu` resource (rules/*.smk: gpu=res(<stage>, "gpu")): every
    rule a config can give GPUs."""
    return {rule for rule, res in rule_resources().items() if "gpu" in res}


def sacct_allocations(job_ids: list[str]) -> dict[str, dict]:
    """{job id: {"partition", "gpus", "cpus", "state"}} from SLURM's accounting (sacct, slurmdbd):
    what SLURM allocated, not what was asked."""
    out = run(["sacct", "-X", "--parsable2", "--noheader", "--format=JobIdRaw,Partition,AllocTRES,AllocCPUS,State",
               "-j", ",".join(job_ids)]).stdout
    jobs = {}
    for line in out.splitlines():
        jid, partition, tres, cpus, state = line.split("|")
        tres = dict(item.split("=", 1) for item in tres.split(",") if "=" in item)
        jobs[jid] = {"partition": partition, "gpus": int(tres.get("gres/gpu", 0)), "cpus": int(cpus), "state": state}
    return jobs


def test_slurm_allocated_every_job_the_gpus_partition_and_cpus_its_config_and_profile_say(runs):
    """Per submitted job, sacct's record against the config (as Snakemake parses it: gpu, and
    threads, which cpus_per_gpu sets for a GPU stage) and the profile (set-resources' partition
    for the rule, else default-resources'). GPU jobs must land on the GPU partition, so a
    profile entry that sends a GPU rule to the default partition fails here too."""
    import yaml

    profile = yaml.safe_load((runs.profile / "config.yaml").read_text())
    entries, default_partition = profile["set-resources"], profile["default-resources"]["slurm_partition"]
    assert default_partition == PARTITION
    # The profile leaves GPUs and CPUs to the config (its step 2), so those are the config's.
    sized = {rule: sorted({"gpu", "gres", "threads", "cpus_per_task", "cpus_per_gpu"} & set(entry or {}))
             for rule, entry in entries.items()}
    assert not any(sized.values()), f"profiles/slurm sets GPUs or CPUs per rule: {sized}"
    asked = rule_resources(runs.slurm_config, runs.slurm_dir)
    jobs = slurm_job_rules(runs.upstream.check()) | slurm_job_rules(runs.pipeline.check())
    allocated = sacct_allocations(list(jobs))
    assert sorted(allocated) == sorted(jobs), f"sacct knows {sorted(allocated)} of the submitted jobs {sorted(jobs)}"
    wrong, seen = [], {}
    for sid, rule in sorted(jobs.items(), key=lambda item: int(item[0])):
        got = allocated[sid]
        want = {"partition": (entries.get(rule) or {}).get("slurm_partition", default_partition),
                "gpus": asked[rule].get("gpu", 0), "cpus": asked[rule]["threads"], "state": "COMPLETED"}
        seen[rule] = got
        if got != want:
            wrong.append(f"{rule} (job {sid}): SLURM allocated {got}, the config and profile say {want}")
        if got["gpus"] and got["partition"] != GPU_PARTITION:
            wrong.append(f"{rule} (job {sid}) got {got['gpus']} GPU(s) on partition {got['partition']!r}, "
                         f"not the GPU partition {GPU_PARTITION!r}: its profile entry is missing or wrong")
    print("\nsacct per rule (partition, GPUs, CPUs): " + ", ".join(
        f"{r} {g['partition']}/{g['gpus']}/{g['cpus']}" for r, g in sorted(seen.items())), file=sys.stderr)
    assert not wrong, "\n".join(wrong)
    # Not vacuous: every GPU rule of the chain got a GPU on the GPU partition with the CPUs
    # cpus_per_gpu gives it, which differ from the CPU rules' (the default's threads).
    gpu_cpus = {seen[r]["cpus"] for r in GPU_RULES}
    assert {r for r in GPU_RULES if seen[r]["gpus"] == 1 and seen[r]["partition"] == GPU_PARTITION} == GPU_RULES, seen
    assert gpu_cpus == {GPU_RESOURCES["traces"]["gpu"] * DEFAULT_RESOURCES["cpus_per_gpu"]}, seen
    assert {seen[r]["cpus"] for r in ("target", "tokenize")} == {DEFAULT_RESOURCES["threads"]} != gpu_cpus, seen
    assert seen["target"]["partition"] == PARTITION and seen["target"]["gpus"] == 0, seen


def test_the_cluster_profile_routes_every_gpu_rule():
    """Without SLURM: every rule that can get GPUs has a set-resources entry in profiles/slurm
    with a partition, so no GPU job falls to the default (CPU) partition."""
    import yaml

    entries = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())["set-resources"]
    rules = gpu_rules()
    assert GPU_RULES | {"train_draft"} <= rules  # the parse found the rules it must
    missing = sorted(r for r in rules if "slurm_partition" not in (entries.get(r) or {}))
    assert not missing, f"profiles/slurm/config.yaml set-resources has no partition for the GPU rule(s) {missing}"
