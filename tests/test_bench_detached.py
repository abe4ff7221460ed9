"""bench/detached.sh, which bench/gpu_vllm_offline.sh and bench/gpu_recipe_offline.sh use to run
their steps detached: a rerun ends the earlier run's steps by the process group they recorded,
and nothing else of the user's, not even a process with the same command line; and no script in
the repository ends processes by their name (pkill -f, killall), which would reach every
Snakemake or vLLM of the user's. Real processes, real signals."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DETACHED = REPO / "bench" / "detached.sh"


def bash(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'source "{DETACHED}" && {code}'], capture_output=True, text=True,
                          timeout=120)


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_a_rerun_ends_its_own_earlier_steps_and_nothing_else(tmp_path):
    work = tmp_path / "work"
    (work / "repo").mkdir(parents=True)
    # The steps as the offline scripts write them: cd into $WORK/repo, then long jobs, one in a
    # subshell (as Snakemake's jobs are children of children).
    steps = work / "steps.sh"
    steps.write_text(f'cd "{work}/repo"\n'
                     f'sleep 300 & echo $! > "{work}/job1"\n'
                     f'bash -c \'sleep 300 & echo $! > "{work}/job2"; wait\' &\n'
                     "wait\n")
    # The user's own processes: the same command line outside $WORK, and one inside $WORK's
    # checkout but in a process group of its own.
    same_name = subprocess.Popen(["sleep", "300"], cwd=tmp_path, start_new_session=True)
    inside_work = subprocess.Popen(["sleep", "300"], cwd=work / "repo", start_new_session=True)
    try:
        started = bash(f'start_steps "{work}" "{steps}" "{work}/steps.out"')
        assert started.returncode == 0 and "started" in started.stdout, started
        assert wait_for(lambda: all((work / f).is_file() and (work / f).read_text().strip()
                                    for f in ("steps.pgid", "job1", "job2")))
        pgid = int((work / "steps.pgid").read_text())
        jobs = [int((work / f).read_text()) for f in ("job1", "job2")]
        assert all(running(p) for p in jobs) and all(os.getpgid(p) == pgid for p in jobs)
        assert pgid not in (os.getpgid(same_name.pid), os.getpgid(inside_work.pid), os.getpgrp())

        stopped = bash(f'stop_earlier_steps "{work}"')
        assert stopped.returncode == 0, stopped
        assert f"process group {pgid}" in stopped.stdout
        assert wait_for(lambda: not any(running(p) for p in jobs)), "the earlier run's jobs still run"
        assert same_name.poll() is None and inside_work.poll() is None, "a process of the user's was ended"
        assert not (work / "steps.pgid").exists()

        # A stale record whose id now names someone else's group (not running in $WORK) is left alone.
        (work / "steps.pgid").write_text(f"{os.getpgid(same_name.pid)}\n")
        stale = bash(f'stop_earlier_steps "{work}"')
        assert stale.returncode == 0 and "stopping" not in stale.stdout, stale
        time.sleep(0.5)
        assert same_name.poll() is None
    finally:
        for proc in (same_name, inside_work):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_no_script_ends_processes_by_name():
    by_name = re.compile(r"\b(pkill|killall)\b")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout.decode().split("\0")
    scripts = [p for p in out if p.endswith((".sh", ".py", ".smk", "Makefile", "Snakefile")) or p.startswith(".ci/")]
    assert "bench/gpu_vllm_offline.sh" in scripts and "bench/detached.sh" in scripts, scripts[:20]
    found = [f"{p}:{n}: {line.strip()}" for p in scripts if p != Path(__file__).relative_to(REPO).as_posix()
             and (REPO / p).is_file()
             for n, line in enumerate((REPO / p).read_text(errors="replace").split("\n"), 1)
             if by_name.search(line)]
    assert not found, "processes ended by name:\n" + "\n".join(found)
