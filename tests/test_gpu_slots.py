"""scripts/run_on_gpus.py: each local GPU job gets its own devices.

No GPU is needed: the pool is a list of fake device ids (PIPELINE_GPU_IDS), which is all the
wrapper's locking needs. The commands it runs are real processes, and the concurrency tests run
a real Snakemake over a throwaway Snakefile whose jobs record the devices they were given."""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from run_on_gpus import parse_nvidia_smi_list

REPO = Path(__file__).resolve().parents[1]
WRAPPER = REPO / "scripts" / "run_on_gpus.py"
PY = sys.executable

# Prints the job's view as JSON; `sleep` (seconds) keeps it busy, a stop file ends it early.
RECORDER = textwrap.dedent("""
    import json, os, sys, time
    out, sleep = sys.argv[1], float(sys.argv[2])
    start = time.time()
    while time.time() - start < sleep and not os.path.exists(out + ".stop"):
        time.sleep(0.05)
    record = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "order": os.environ.get("CUDA_DEVICE_ORDER"),
              "start": start, "end": time.time(), "pid": os.getpid()}
    with open(out + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(out + ".tmp", out)
""")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would change the wrapper's decision."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PIPELINE_GPU_IDS", "PIPELINE_GPU_LOCK_DIR",
                        "PIPELINE_GPU_WAIT_S") and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def wrap(gpus: int, *command: str, cwd: Path, env: dict[str, str], timeout: float = 60,
         extra_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(WRAPPER), "--gpus", str(gpus), *extra_args, "--", *command],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start_wrapped(gpus: int, *command: str, cwd: Path, env: dict[str, str],
                  extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    # Its own session: no controlling terminal, so signals reach it only as the test sends them.
    return subprocess.Popen([PY, str(WRAPPER), "--gpus", str(gpus), *extra_args, "--", *command],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.fixture
def recorder(tmp_path) -> Path:
    path = tmp_path / "recorder.py"
    path.write_text(RECORDER)
    return path


def read_record(path: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return json.loads(path.read_text())


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


SHOW_CVD = ("python3", "-c", "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")


# --- where the devices come from ---------------------------------------------------------


def test_help_documents_the_modes(tmp_path):
    out = subprocess.run([PY, str(WRAPPER), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for phrase in ("--gpus", "PIPELINE_GPU_IDS", "PIPELINE_GPU_LOCK_DIR", "SLURM", "--wait-timeout"):
        assert phrase in out.stdout


# PIPELINE_GPU_IDS="" declares a machine without GPUs (so this holds on a GPU machine too).
@pytest.mark.parametrize("machine_ids, expected", [("0,1", "''"), ("", "None")])
def test_cpu_job_hides_gpus_only_where_there_are_some(tmp_path, machine_ids, expected):
    env = clean_env(PIPELINE_GPU_IDS=machine_ids)
    out = wrap(0, *SHOW_CVD, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
    # A CPU job never takes a lock.
    assert not (tmp_path / ".snakemake").exists()


def test_cpu_job_on_gpu_machine_hides_even_pinned_devices(tmp_path):
    out = wrap(0, *SHOW_CVD, cwd=tmp_path, env=clean_env(PIPELINE_GPU_IDS="0,1", CUDA_VISIBLE_DEVICES="1"))
    assert out.stdout.strip() == "''"


def test_slurm_job_keeps_the_devices_slurm_gave(tmp_path):
    env = clean_env(SLURM_JOB_ID="77", CUDA_VISIBLE_DEVICES="1", PIPELINE_GPU_IDS="0,1")
    out = wrap(1, *SHOW_CVD, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "'1'"
    assert "SLURM job 77 gave CUDA_VISIBLE_DEVICES=1" in out.stderr
    assert not (tmp_path / ".snakemake").exists(), "SLURM already isolates jobs: no local locks"


def test_slurm_job_with_too_few_devices_fails_clearly(tmp_path):
    env = clean_env(SLURM_JOB_ID="78", CUDA_VISIBLE_DEVICES="0", SLURM_NNODES="1")
    out = wrap(2, *SHOW_CVD, cwd=tmp_path, env=env)
    assert out.returncode == 2
    assert "SLURM job 78" in out.stderr and "needs 2" in out.stderr and "profiles/slurm" in out.stderr
    assert out.stdout == "", "the command must not run"


def test_pinned_devices_are_the_pool(tmp_path):
    lock_dir = tmp_path / "locks"
    env = clean_env(CUDA_VISIBLE_DEVICES="3,5", PIPELINE_GPU_LOCK_DIR=str(lock_dir))
    one = wrap(1, *SHOW_CVD, cwd=tmp_path, env=env)
    two = wrap(2, *SHOW_CVD, cwd=tmp_path, env=env)
    assert one.stdout.strip() in ("'3'", "'5'")
    assert two.stdout.strip() == "'3,5'"
    assert sorted(p.name.split(".gpu-")[1] for p in lock_dir.iterdir()) == ["3.lock", "5.lock"]
    three = wrap(3, *SHOW_CVD, cwd=tmp_path, env=env)
    assert three.returncode == 2 and "needs 3 GPU(s)" in three.stderr and "pinned" in three.stderr


@pytest.mark.parametrize("env_extra, gpus, message", [
    ({"PIPELINE_GPU_IDS": "0,1,0"}, 1, "PIPELINE_GPU_IDS='0,1,0' lists device ids ['0'] more than once"),
    ({"PIPELINE_GPU_IDS": ""}, 1, "resources gpu to 0"),
    ({"PIPELINE_GPU_IDS": "0,1"}, 4, "needs 4 GPU(s) but the GPU pool has only 2 (0, 1)"),
    ({"PIPELINE_GPU_IDS": "0", "PIPELINE_GPU_WAIT_S": "soon"}, 1, "PIPELINE_GPU_WAIT_S='soon' is not a number"),
])
def test_bad_setup_is_a_clear_error(tmp_path, env_extra, gpus, message):
    out = wrap(gpus, *SHOW_CVD, cwd=tmp_path, env=clean_env(**env_extra))
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_bad_command_lines(tmp_path):
    env = clean_env(PIPELINE_GPU_IDS="0")
    no_dashes = subprocess.run([PY, str(WRAPPER), "--gpus", "1", "true"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
    assert no_dashes.returncode == 2 and "unrecognized arguments" in no_dashes.stderr
    no_command = subprocess.run([PY, str(WRAPPER), "--gpus", "1", "--"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
    assert no_command.returncode == 2 and "no command given" in no_command.stderr
    missing = wrap(1, "no-such-program-xyz", cwd=tmp_path, env=env)
    assert missing.returncode == 2 and "cannot run 'no-such-program-xyz'" in missing.stderr


def test_nvidia_smi_listing_is_parsed():
    # The first line as `nvidia-smi -L` printed it on an H200 node; a second GPU and a MIG
    # slice line in the same format (MIG slices are not addressable by index: not pool ids).
    listing = ("GPU 0: NVIDIA H200 (UUID: GPU-cf4271ab-a9e2-eecb-a1ff-05c9080856be)\n"
               "GPU 1: NVIDIA H200 (UUID: GPU-9a52e0aa-51f0-0a6c-6f8e-0c1bd27f3f1e)\n"
               "  MIG 1g.18gb     Device  0: (UUID: MIG-5f8a7c1e-2b3d-5e4f-8a9b-0c1d2e3f4a5b)\n")
    assert parse_nvidia_smi_list(listing) == ["0", "1"]
    assert parse_nvidia_smi_list("No devices were found\n") == []


# --- the command's life: exit status, signals, locks held until it ends -----------------


def test_exit_status_is_the_commands(tmp_path):
    env = clean_env(PIPELINE_GPU_IDS="0")
    out = wrap(1, "python3", "-c", "import sys; sys.exit(7)", cwd=tmp_path, env=env)
    assert out.returncode == 7
    assert "run_on_gpus: CUDA_VISIBLE_DEVICES=0 (1 of 1 GPU(s) from PIPELINE_GPU_IDS" in out.stderr
    killed = wrap(1, "python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", cwd=tmp_path, env=env)
    assert killed.returncode == -signal.SIGKILL, "a command killed by a signal makes the wrapper die the same way"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_the_command(tmp_path, signum):
    marker = tmp_path / "got-signal"
    child = textwrap.dedent(f"""
        import signal, sys, time
        def on_signal(signum, frame):
            open({str(marker)!r}, "w").write(str(signum))
            sys.exit(3)
        signal.signal({int(signum)}, on_signal)
        open({str(marker)!r} + ".ready", "w").close()
        time.sleep(60)
    """)
    proc = start_wrapped(1, "python3", "-c", child, cwd=tmp_path, env=clean_env(PIPELINE_GPU_IDS="0"))
    try:
        wait_for(lambda: Path(str(marker) + ".ready").exists(), 30, "the command to start")
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 3, "the wrapper exits with the command's status"
    finally:
        proc.kill()
        proc.wait()
    assert marker.read_text() == str(int(signum))


def test_busy_devices_make_a_job_wait_then_time_out_naming_the_holder(tmp_path, recorder):
    env = clean_env(PIPELINE_GPU_IDS="0")
    holder = start_wrapped(1, PY, str(recorder), str(tmp_path / "holder.json"), "60", cwd=tmp_path, env=env)
    try:
        wait_for(lambda: any((tmp_path / ".snakemake" / "gpu-locks").glob("*.gpu-0.lock")), 30, "the lock")
        time.sleep(0.5)
        t0 = time.monotonic()
        late = wrap(1, *SHOW_CVD, cwd=tmp_path, env=env, extra_args=("--wait-timeout", "1.5"))
        assert time.monotonic() - t0 >= 1.5
        assert late.returncode == 2 and late.stdout == ""
        assert "waiting for 1 free GPU(s) of [0]" in late.stderr
        assert f"gave up after 2 s waiting for 1 free GPU(s) of [0]" in late.stderr
        assert f"pid {holder.pid} (python" in late.stderr, late.stderr
    finally:
        holder.kill()
        holder.wait()


def test_killed_job_frees_its_device_and_its_command_dies_with_it(tmp_path, recorder):
    env = clean_env(PIPELINE_GPU_IDS="0")
    out = tmp_path / "victim.json"
    victim = start_wrapped(1, "sh", "-c", f"echo $$ > {tmp_path}/victim.pid; exec sleep 60", cwd=tmp_path, env=env)
    pid_file = tmp_path / "victim.pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the command to start")
    command_pid = int(pid_file.read_text())
    victim.kill()  # SIGKILL: no chance to clean up; the kernel drops the flock
    victim.wait(timeout=30)
    wait_for(lambda: not Path(f"/proc/{command_pid}").exists() or
             Path(f"/proc/{command_pid}/stat").read_text().split()[2] == "Z", 10,
             "the orphaned command to be killed (PR_SET_PDEATHSIG)")
    t0 = time.monotonic()
    nxt = wrap(1, PY, str(recorder), str(out), "0", cwd=tmp_path, env=env, extra_args=("--wait-timeout", "10"))
    assert nxt.returncode == 0, nxt.stderr
    assert time.monotonic() - t0 < 5 and "waiting" not in nxt.stderr
    assert read_record(out)["cvd"] == "0"


def test_waiting_job_starts_when_the_device_is_freed(tmp_path, recorder):
    env = clean_env(PIPELINE_GPU_IDS="0")
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    a = start_wrapped(1, PY, str(recorder), str(first), "60", cwd=tmp_path, env=env)
    b = None
    try:
        wait_for(lambda: any((tmp_path / ".snakemake" / "gpu-locks").glob("*.gpu-0.lock")), 30, "the lock")
        b = start_wrapped(1, PY, str(recorder), str(second), "0", cwd=tmp_path, env=env,
                          extra_args=("--wait-timeout", "60"))
        time.sleep(1.0)
        assert b.poll() is None, "the second job must wait while the only GPU is held"
        Path(str(first) + ".stop").touch()
        assert a.wait(timeout=30) == 0
        assert b.wait(timeout=30) == 0
        b_err = b.stderr.read()
        assert "waiting for 1 free GPU(s) of [0]" in b_err and "CUDA_VISIBLE_DEVICES=0" in b_err
    finally:
        for p in (a, b):
            if p is not None:
                p.kill()
                p.wait()
    r1, r2 = read_record(first), read_record(second)
    assert r2["start"] >= r1["end"], "the second job ran while the first still held the device"


# --- a real Snakemake run: jobs counted by Snakemake, devices given by the wrapper --------

SNAKEFILE = textwrap.dedent("""
    # Throwaway workflow: {n_one} one-GPU jobs and one two-GPU job, each recording its devices.
    PY = {py!r}
    WRAP = {wrapper!r}
    REC = {recorder!r}

    rule all:
        input: expand("out/one_{{i}}.json", i=range({n_one})), "out/two.json"

    rule one:
        output: "out/one_{{i}}.json"
        resources: gpu=1
        shell: "{{PY}} {{WRAP}} --gpus 1 -- {{PY}} {{REC}} {{output}} {sleep} 2> logs/one_{{wildcards.i}}.log"

    rule two:
        output: "out/two.json"
        resources: gpu=2
        shell: "{{PY}} {{WRAP}} --gpus 2 -- {{PY}} {{REC}} {{output}} {sleep} 2> logs/two.log"
""")


def run_gpu_workflow(workdir: Path, recorder: Path, n_one: int, cores: int, gpu_budget: int,
                     pool: str, sleep: float = 1.0) -> tuple[dict[str, dict], float]:
    workdir.mkdir()
    (workdir / "logs").mkdir()
    snakefile = workdir / "Snakefile"
    snakefile.write_text(SNAKEFILE.format(py=PY, wrapper=str(WRAPPER), recorder=str(recorder),
                                          n_one=n_one, sleep=sleep))
    env = clean_env(PIPELINE_GPU_IDS=pool, PIPELINE_GPU_WAIT_S="120")
    t0 = time.monotonic()
    proc = subprocess.run([PY, "-m", "snakemake", "-s", str(snakefile), "-d", str(workdir), "--cores", str(cores),
                           "--resources", f"gpu={gpu_budget}"], env=env, capture_output=True, text=True,
                          timeout=300)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = {p.stem: json.loads(p.read_text()) for p in (workdir / "out").glob("*.json")}
    assert len(records) == n_one + 1
    return records, wall


def devices(record: dict) -> set[str]:
    return set(record["cvd"].split(","))


def overlapping_pairs(records: dict[str, dict]):
    for (a, ra), (b, rb) in itertools.combinations(records.items(), 2):
        if ra["start"] < rb["end"] and rb["start"] < ra["end"]:
            yield a, ra, b, rb


def assert_no_shared_device(records: dict[str, dict], pool: set[str]) -> int:
    for name, r in records.items():
        assert r["cvd"], f"{name} ran without CUDA_VISIBLE_DEVICES"
        assert devices(r) <= pool, f"{name} got {r['cvd']}, outside the pool {pool}"
    pairs = list(overlapping_pairs(records))
    for a, ra, b, rb in pairs:
        assert not devices(ra) & devices(rb), f"{a} ({ra['cvd']}) and {b} ({rb['cvd']}) ran at once on one device"
    return len(pairs)


def max_concurrency(records: dict[str, dict]) -> int:
    events = sorted([(r["start"], 1) for r in records.values()] + [(r["end"], -1) for r in records.values()],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_snakemake_jobs_get_disjoint_devices(tmp_path, recorder):
    """The common case: Snakemake counts gpu=2, the wrapper picks which two."""
    workdir = tmp_path / "wf"
    records, wall = run_gpu_workflow(workdir, recorder, n_one=6, cores=4, gpu_budget=2, pool="0,1")
    assert assert_no_shared_device(records, {"0", "1"}) >= 1, "no two jobs ran at the same time"
    assert max_concurrency(records) == 2
    assert devices(records["two"]) == {"0", "1"} and len(records["two"]["cvd"].split(",")) == 2
    # The default lock dir is .snakemake/gpu-locks in Snakemake's working directory.
    assert sorted(p.name.split(".gpu-")[1] for p in (workdir / ".snakemake" / "gpu-locks").iterdir()) \
        == ["0.lock", "1.lock"]
    for log in (workdir / "logs").iterdir():
        lines = [line for line in log.read_text().splitlines() if line.startswith("run_on_gpus:")]
        assert len(lines) == 1 and "CUDA_VISIBLE_DEVICES=" in lines[0], log.read_text()
    print(f"6x1-GPU + 1x2-GPU jobs on 2 fake GPUs: {wall:.1f} s")


def test_wrapper_holds_jobs_back_when_snakemake_oversubscribes(tmp_path, recorder):
    """Snakemake told there are 6 GPUs while the pool has 2: the locks alone keep jobs apart."""
    workdir = tmp_path / "wf"
    records, wall = run_gpu_workflow(workdir, recorder, n_one=4, cores=6, gpu_budget=6, pool="0,1")
    assert assert_no_shared_device(records, {"0", "1"}) >= 1
    assert max_concurrency(records) <= 2
    waited = [log.name for log in (workdir / "logs").iterdir() if "waiting for" in log.read_text()]
    assert waited, "Snakemake started more jobs than GPUs, so some job must have waited for a lock"
    print(f"4x1-GPU + 1x2-GPU jobs, 6 started at once on 2 fake GPUs: {wall:.1f} s, waited: {waited}")
