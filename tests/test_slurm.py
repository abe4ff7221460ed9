"""profiles/slurm against a REAL single-node SLURM cluster (tests/slurm_cluster.py).

Every job goes through sbatch/srun; of the shipped profile only the partition/account
placeholders and the status-check settings are replaced (no slurmdbd here, so squeue).
One module fixture runs, at the same time (each mostly waits on SLURM's status polls):
  - a throwaway workflow whose jobs ask for gpu=1 / gpu=2, run through SLURM;
  - the pipeline up to PIPELINE_TARGETS, run through SLURM;
  - the same pipeline targets run locally, as the reference.
The tests then inspect what each produced. SLURM is never skipped: without it these tests fail
and say to run .ci/install_slurm.sh."""
from __future__ import annotations

import itertools
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PY, REPO, base_test_config, write_config
from pipeline_lib.digests import path_digest
from slurm_cluster import NUM_GPUS, PARTITION, BoundedRun, make_test_profile, slurm_cluster  # noqa: F401

# The pipeline outputs built through SLURM and compared with a local run. Extend this list as
# more stages work on the CI box (e.g. up to the drafts' reports) and raise RUN_TIMEOUT_S.
PIPELINE_TARGETS = [
    "results/tiny/target/model",
    "results/tiny/target/manifest.json",
    "results/tiny/prompts/train.jsonl",
    "results/tiny/prompts/eval.jsonl",
]
RUN_TIMEOUT_S = 600
# The only rules that may run on the submitting host: the `localrules` of rules/common.smk.
LOCAL_RULES = {"all", "traces_gather", "hidden_states_gather", "compare_variants", "plan"}
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
        shell: "python {{WRAP}} --gpus {{resources.gpu}} -- python {{REC}} {{output}} 3 2> {{log}}"

    rule gpu_two:
        output: "out/gpu2.json"
        log: "logs/gpu2.log"
        resources: gpu=2, mem_mb=200, runtime=5
        shell: "python {{WRAP}} --gpus {{resources.gpu}} -- python {{REC}} {{output}} 3 2> {{log}}"
""")


@dataclass
class Runs:
    gpu_dir: Path
    gpu: BoundedRun
    slurm_dir: Path
    pipeline: BoundedRun
    local_dir: Path
    local: BoundedRun


def snakemake_command(snakefile: Path, workdir: Path, *args: str) -> list[str]:
    return [PY, "-m", "snakemake", "-s", str(snakefile), "-d", str(workdir), *args]


@pytest.fixture(scope="module")
def runs(slurm_cluster, tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-runs")
    profile = make_test_profile(REPO / "profiles" / "slurm", root / "profile")

    gpu_dir = root / "gpu-wf"
    gpu_dir.mkdir()
    (gpu_dir / "recorder.py").write_text(RECORDER)
    (gpu_dir / "Snakefile").write_text(GPU_SNAKEFILE.format(wrapper=str(REPO / "scripts" / "run_on_gpus.py"),
                                                            recorder=str(gpu_dir / "recorder.py")))
    config = base_test_config(tiny_target)
    slurm_dir, local_dir = root / "pipeline-slurm", root / "pipeline-local"
    slurm_cfg, local_cfg = write_config(slurm_dir, config), write_config(local_dir, config)

    started = [
        gpu := BoundedRun(snakemake_command(gpu_dir / "Snakefile", gpu_dir, "--workflow-profile", str(profile)),
                          root / "gpu-wf.log", RUN_TIMEOUT_S),
        pipeline := BoundedRun(snakemake_command(REPO / "Snakefile", slurm_dir, "--configfile", str(slurm_cfg),
                                                 "--workflow-profile", str(profile), *PIPELINE_TARGETS),
                               root / "pipeline-slurm.log", RUN_TIMEOUT_S),
        # The reference: same Snakefile, config and targets, local execution (profiles/default).
        local := BoundedRun(snakemake_command(REPO / "Snakefile", local_dir, "--configfile", str(local_cfg),
                                              "--cores", "2", *PIPELINE_TARGETS),
                            root / "pipeline-local.log", RUN_TIMEOUT_S),
    ]
    try:
        BoundedRun.wait_all(started)
        yield Runs(gpu_dir, gpu, slurm_dir, pipeline, local_dir, local)
    finally:
        for run in started:  # when the wait above was cut short (e.g. Ctrl-C): nothing keeps running
            run.interrupt()
        print(f"\nSLURM test wall times (all at once): GPU workflow {gpu.wall_s:.1f} s, pipeline via SLURM "
              f"{pipeline.wall_s:.1f} s, pipeline locally {local.wall_s:.1f} s", file=sys.stderr)


def test_every_job_goes_through_sbatch_and_its_slurm_log_is_kept(runs):
    for run, expected_remote in ((runs.gpu, 3), (runs.pipeline, None)):
        log = run.check()
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


def test_pipeline_jobs_ran_inside_slurm_jobs(runs):
    submitted = submitted_jobs(runs.pipeline.check())
    # provenance.json records SLURM_JOB_ID (pipeline_lib.provenance.ENV_ALLOW_LIST): every
    # artifact of a submitted rule names one of the submitted jobs; localrules' name none.
    provenance = sorted((runs.slurm_dir / "results").rglob("*provenance.json"))
    assert provenance, "the pipeline wrote no provenance.json"
    for path in provenance:
        record = json.loads(path.read_text())
        job = record.get("env", {}).get("SLURM_JOB_ID")
        if record["rule"] in LOCAL_RULES:
            assert job is None, f"{path}: localrule {record['rule']} ran inside SLURM job {job}"
        else:
            assert job in submitted, f"{path}: rule {record['rule']} ran in SLURM job {job}, submitted: {submitted}"


def test_pipeline_targets_through_slurm_match_a_local_run(runs):
    runs.pipeline.check()
    runs.local.check()
    for target in PIPELINE_TARGETS:
        assert path_digest(runs.slurm_dir / target) == path_digest(runs.local_dir / target), \
            f"{target} differs between the SLURM run and the local run"
