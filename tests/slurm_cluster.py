"""A real single-node SLURM cluster on this machine, for tests of the cluster profile.

Debian's slurmctld/slurmd (22.05) and munge, with accounting (slurmdbd on a private MariaDB,
so `sacct` answers as on a production cluster), started by hand as root (no init system), each
in the foreground as a child of the test process, so it is stopped by its own pid. The node
advertises NUM_GPUS fake GPUs (character-device clones of /dev/null), enough for SLURM to hand
out gres/gpu and set CUDA_VISIBLE_DEVICES, and sits in two partitions: the default one for CPU
jobs and a GPU one, so that sacct shows which partition the profile sent each job to. Facts behind each choice: shared notes, slurm-local.md.

It needs root and SLURM's binaries: where either is missing, the tests that use it are skipped
before it starts, each with the reason, and the end of `make test` names them with the command
that runs them (`sudo make test-root`); under ROOT_TESTS=require (CI, which installs SLURM with
.ci/install_slurm.sh as root) they fail instead (tests/conftest.py: needs_root). Every wait is
bounded; on the way out every job is cancelled and every daemon this module started is stopped,
even when the test failed."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

SLURM_CONF = Path("/etc/slurm/slurm.conf")
GRES_CONF = Path("/etc/slurm/gres.conf")
SLURMDBD_CONF = Path("/etc/slurm/slurmdbd.conf")
# Both configs must live in /etc/slurm: the jobstep plugin deletes every SLURM_* variable,
# SLURM_CONF included, before its inner srun. This marker says a config is ours to rewrite.
MARKER = "# Test cluster written by tests/slurm_cluster.py: safe to delete."
STATE = Path("/var/lib/pipeline-test-slurm")
MUNGE_SOCKET_DIR = Path("/run/munge")
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")  # start order
BINARIES = ("munge", "unmunge", "munged", "mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "slurmctld",
            "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "sacct", "sacctmgr")
INSTALL_HINT = ("run `make slurm` as root (CI's .ci/run does) to install slurmctld, slurmd, "
                "slurmdbd, slurm-client, munge and mariadb-server")

PARTITION = "pipelinetest"   # the default one: CPU rules (the profile's default-resources)
GPU_PARTITION = "gpu"        # the rules the profile's set-resources route to a GPU partition
ACCOUNT = "pipeline-test"
NUM_GPUS = 8          # fake: enough for the tests' GPU jobs to all run at once (the throwaway workflow takes 4, a pipeline GPU job 1)
NODE_CPUS = 16         # more than the 2 real cores (config_overrides): every job of the runs can start at once
NODE_MEM_MB = 160000   # not enforced (no cgroups); the pipeline's rules ask for 8000 each
MIN_JOB_AGE_S = 1800   # squeue (and scontrol, which the tests ask) keep finished jobs this long: >= 3x the status-check delay
SLURMDBD_PORT = 6819   # SLURM's default
DB_USER, DB_NAME = "slurm", "slurm_acct_db"
# A cluster-wide count of 2: jobs asking for it (`--licenses=vllm`) run at most two at a time,
# queued by SLURM itself, as GPU jobs would on a node with two GPUs (a 2-core machine takes two
# one-thread vLLM engines; the tests' configs give every stage one thread).
LICENSE, LICENSE_COUNT = "vllm", 2


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def require_slurm() -> None:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"SLURM is not installed here (missing: {', '.join(missing)}); {INSTALL_HINT}", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the SLURM test starts slurmctld/slurmd/munged and writes /etc/slurm: run it as root "
                    "(CI runs as root)", pytrace=False)


def run(cmd: list[str], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    exe = _which(cmd[0]) or cmd[0]
    proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def wait_until(predicate, timeout: float, what: str, on_timeout=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except (subprocess.SubprocessError, OSError, RuntimeError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}. {on_timeout()}")
        time.sleep(0.25)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class SlurmCluster:
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    state: Path = STATE
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    db_port: int = 0
    start_s: float | None = None  # wall time of start(), for the test's timing summary

    # --- configuration --------------------------------------------------------------------

    @property
    def gpu_files(self) -> list[Path]:
        return [self.state / f"fake-gpu{i}" for i in range(NUM_GPUS)]

    def slurm_conf(self) -> str:
        s = self.state
        return "\n".join([
            MARKER,
            "ClusterName=pipelinetest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={s}/ctld",
            f"SlurmdSpoolDir={s}/spool",
            f"SlurmctldPidFile={s}/slurmctld.daemon.pid",
            f"SlurmdPidFile={s}/slurmd.daemon.pid",
            f"SlurmctldLogFile={s}/slurmctld.log",
            f"SlurmdLogFile={s}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            # Accounting through slurmdbd: what makes `sacct` (the plugin's default status command) work.
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={SLURMDBD_PORT}",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            f"MinJobAge={MIN_JOB_AGE_S}",
            "GresTypes=gpu",
            # sacct's AllocTRES then counts each job's GPUs (22.05 tracks cpu/mem/node only by default).
            "AccountingStorageTRES=gres/gpu",
            f"Licenses={LICENSE}:{LICENSE_COUNT}",
            "SlurmdParameters=config_overrides",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory={NODE_MEM_MB} "
            f"Gres=gpu:{NUM_GPUS} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            # The same node: sacct's Partition then shows where the profile sent each job.
            f"PartitionName={GPU_PARTITION} Nodes={self.node} Default=NO MaxTime=INFINITE State=UP",
            "",
        ])

    def slurmdbd_conf(self) -> str:
        s = self.state
        return "\n".join([
            MARKER,
            "AuthType=auth/munge",
            f"DbdHost={self.node}",
            "DbdAddr=127.0.0.1",
            f"DbdPort={SLURMDBD_PORT}",
            "SlurmUser=root",
            f"PidFile={s}/slurmdbd.daemon.pid",
            f"LogFile={s}/slurmdbd.log",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={self.db_port}",
            f"StorageUser={DB_USER}",
            f"StorageLoc={DB_NAME}",
            "",
        ])

    def gres_conf(self) -> str:
        files = ",".join(str(p) for p in self.gpu_files)
        return f"{MARKER}\nAutoDetect=off\nNodeName={self.node} Name=gpu File={files}\n"

    def write_config(self) -> None:
        for path in (SLURM_CONF, GRES_CONF, SLURMDBD_CONF):
            if path.exists() and MARKER not in path.read_text(errors="replace"):
                pytest.fail(f"{path} exists and was not written by this test: refusing to overwrite a real "
                            f"SLURM configuration. Run this test on a machine without one (CI's is fresh).",
                            pytrace=False)
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SLURM_CONF.write_text(self.slurm_conf())
        GRES_CONF.write_text(self.gres_conf())
        # slurmdbd refuses a config others may read (it could hold the database password).
        SLURMDBD_CONF.touch(mode=0o600)
        SLURMDBD_CONF.chmod(0o600)
        SLURMDBD_CONF.write_text(self.slurmdbd_conf())

    def make_fake_gpus(self) -> None:
        # gres/gpu needs File= character devices; clones of /dev/null (major 1, minor 3) do.
        for path in self.gpu_files:
            if not (path.exists() and stat.S_ISCHR(path.stat().st_mode)):
                path.unlink(missing_ok=True)
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            path.chmod(0o666)

    # --- daemons ------------------------------------------------------------------------------

    def pid_record(self, name: str) -> Path:
        return self.state / f"{name}.pid"

    def stop_leftovers(self) -> None:
        """Daemons a crashed earlier run of this module left, found by the pid files it wrote."""
        for name in DAEMONS:
            record = self.pid_record(name)
            try:
                pid = int(record.read_text().strip())
                exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            except (OSError, ValueError):
                record.unlink(missing_ok=True)
                continue
            if exe.startswith(name):  # slurmctld's binary is slurmctld-wlm on Debian
                _stop_pid(pid, name)
            record.unlink(missing_ok=True)

    def spawn(self, name: str, cmd: list[str], **kw) -> None:
        log = open(self.state / f"{name}.stdout.log", "ab")
        try:
            proc = subprocess.Popen([_which(cmd[0]), *cmd[1:]], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        finally:
            log.close()
        self.procs[name] = proc
        self.pid_record(name).write_text(f"{proc.pid}\n")

    def munge_works(self) -> bool:
        cred = run(["munge", "-n"], timeout=10, check=False)
        return cred.returncode == 0 and run(["unmunge"], input=cred.stdout, timeout=10, check=False).returncode == 0

    def start_munge(self) -> None:
        if self.munge_works():  # a munged is already serving this machine: use it, leave it alone
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            run(["mungekey", "--create", f"--keyfile={key}"])
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
        MUNGE_SOCKET_DIR.chmod(0o755)
        self.spawn("munged", ["munged", "--foreground"], user="munge", group="munge")
        wait_until(self.munge_works, 20, "munged to answer",
                   lambda: tail(self.state / "munged.stdout.log") + tail(Path("/var/log/munge/munged.log")))

    def db(self, sql: str) -> subprocess.CompletedProcess:
        # As root over the private socket (unix_socket authentication: no password anywhere).
        return run(["mariadb", "--no-defaults", f"--socket={self.state}/mariadb.sock", "-e", sql], timeout=10)

    def start_accounting(self) -> None:
        """A private MariaDB (fresh data dir, loopback only) and slurmdbd on it, with this test's
        cluster, account and user registered, as `sacctmgr` would be used on a real cluster."""
        data = self.state / "mariadb"
        shutil.rmtree(data, ignore_errors=True)
        run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
             "--auth-root-authentication-method=socket", "--skip-test-db"], timeout=120)
        self.spawn("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={self.state}/mariadb.sock",
                                f"--port={self.db_port}", "--bind-address=127.0.0.1", "--skip-name-resolve",
                                "--user=root", f"--log-error={self.state}/mariadb.log",
                                "--innodb-buffer-pool-size=32M"])
        wait_until(lambda: self.db("SELECT 1").returncode == 0, 30, "mariadbd to answer",
                   lambda: tail(self.state / "mariadb.log"))
        self.db(f"CREATE USER '{DB_USER}'@'127.0.0.1'; GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1';")
        self.spawn("slurmdbd", ["slurmdbd", "-D"])
        wait_until(lambda: run(["sacctmgr", "-n", "show", "cluster"], timeout=10).returncode == 0, 30,
                   "slurmdbd to answer `sacctmgr show cluster`", lambda: tail(self.state / "slurmdbd.log"))
        for entity in (["cluster", "pipelinetest"], ["account", ACCOUNT, "cluster=pipelinetest"],
                       ["user", "root", f"account={ACCOUNT}", "cluster=pipelinetest"]):
            run(["sacctmgr", "-i", "add", *entity], timeout=30)

    def node_state(self) -> str:
        return run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], timeout=10).stdout.strip()

    def start(self) -> None:
        require_slurm()
        self.state.mkdir(parents=True, exist_ok=True)
        self.stop_leftovers()
        # A fresh controller state every time: no queued jobs or drained node from an earlier run.
        for sub in ("ctld", "spool"):
            shutil.rmtree(self.state / sub, ignore_errors=True)
            (self.state / sub).mkdir()
        for log in self.state.glob("*.log"):
            log.unlink()
        self.make_fake_gpus()
        self.db_port = free_port()
        self.write_config()
        self.start_munge()
        self.start_accounting()
        self.spawn("slurmctld", ["slurmctld", "-D", "-i"])
        wait_until(lambda: "UP" in run(["scontrol", "ping"], timeout=10, check=False).stdout, 30,
                   "slurmctld to answer `scontrol ping`", self.logs)
        self.spawn("slurmd", ["slurmd", "-D", "-N", self.node])
        wait_until(self.node_is_usable, 45, f"node {self.node} to become idle", self.logs)

    def node_is_usable(self) -> bool:
        state = self.node_state()
        if any(word in state for word in ("drain", "down", "fail")):
            # A drained node stays drained until resumed (even across restarts).
            run(["scontrol", "update", f"nodename={self.node}", "state=resume"], timeout=10, check=False)
            return False
        return state.startswith(("idle", "mixed", "allocated"))

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{tail(self.state / name)}"
                         for name in ("slurmctld.log", "slurmd.log", "slurmdbd.log", "slurmctld.stdout.log",
                                      "slurmd.stdout.log"))

    # --- jobs ---------------------------------------------------------------------------------

    def active_job_ids(self) -> list[str]:
        out = run(["squeue", "-h", "-t", "PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED", "-o", "%i"],
                  timeout=10)
        return out.stdout.split()

    def cancel_all_jobs(self) -> None:
        ids = self.active_job_ids()
        if ids:
            run(["scancel", *ids], timeout=20, check=False)
            wait_until(lambda: not self.active_job_ids(), 30, f"jobs {ids} to end after scancel")

    # --- shutdown -----------------------------------------------------------------------------

    def stop(self) -> None:
        errors = []
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.cancel_all_jobs()
            except Exception as err:  # still stop the daemons
                errors.append(f"cancelling jobs: {err}")
        for name in reversed(DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is not None:
                _stop_pid(proc.pid, name, proc)
                self.pid_record(name).unlink(missing_ok=True)
        # Our config must not outlive the cluster: with /etc/slurm/slurm.conf present, the SLURM
        # executor plugin's `scontrol show config` waits ~9 s for the stopped controller at every
        # later `snakemake` start (every dry-run of the tests that follow).
        for path in (SLURM_CONF, GRES_CONF, SLURMDBD_CONF):
            if path.exists() and MARKER in path.read_text(errors="replace"):
                path.unlink()
        if errors:
            raise RuntimeError("; ".join(errors))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_pid(pid: int, name: str, proc: subprocess.Popen | None = None, grace: float = 15) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; reaps our own children."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if proc is not None:
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm_cluster():
    cluster = SlurmCluster()
    try:
        started = time.monotonic()
        cluster.start()
        cluster.start_s = time.monotonic() - started
        yield cluster
    finally:
        cluster.stop()


# --- Snakemake through the profile ----------------------------------------------------------


def make_test_profile(source: Path, dest: Path, licensed: tuple[str, ...] = (), **overrides) -> Path:
    """A copy of a SLURM profile with this cluster's partitions/account and quick status checks.

    The placeholders map to this cluster's names: the default partition's (wherever it appears)
    to PARTITION, every other partition a set-resources entry names to GPU_PARTITION. Every other key is kept as the user would get it, the status command (`sacct`, which this
    cluster's slurmdbd answers) included unless `overrides` names another. Jobs of the rules in
    `licensed` ask for one of the cluster's LICENSE_COUNT LICENSEs."""
    profile = yaml.safe_load((source / "config.yaml").read_text())
    default_partition = profile["default-resources"].get("slurm_partition")
    profile["default-resources"].update({"slurm_partition": PARTITION, "slurm_account": ACCOUNT,
                                         "mem_mb": 1000, "runtime": 10})
    for rule_resources in (profile.get("set-resources") or {}).values():
        if "slurm_partition" in rule_resources:
            # An entry that names the default partition stays on it (and a GPU job there fails the test).
            rule_resources["slurm_partition"] = (PARTITION if rule_resources["slurm_partition"] == default_partition
                                                 else GPU_PARTITION)
    for rule in licensed:
        profile.setdefault("set-resources", {}).setdefault(rule, {})["slurm_extra"] = f"--licenses={LICENSE}"
    profile.update({
        # The plugin waits this long before its first status check and after every check that
        # saw a job finish (it adds 10 s after each that saw none); the profile's 20 s is for
        # a busy controller, this one is idle.
        "slurm-init-seconds-before-status-checks": 1,
        "latency-wait": 5,
        "jobs": 4,
    })
    profile.update(overrides)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return dest


class BoundedRun:
    """A command (Snakemake) started now and waited for later, its output in a file.

    Past its deadline it gets SIGINT (Snakemake ignores SIGTERM while it polls SLURM; on SIGINT
    it cancels its SLURM jobs and exits), then SIGKILL if it still has not stopped."""

    def __init__(self, cmd: list[str], log_path: Path, timeout: float, env: dict | None = None):
        self.cmd, self.log_path = cmd, log_path
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            # SIGINT must work on it even where this process was started with SIGINT ignored
            # (a background job of a non-interactive shell).
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.wall_s: float | None = None
        self.timed_out = False

    def poll(self) -> bool:
        """True once finished (and records the wall time then)."""
        if self.proc.poll() is None:
            return False
        if self.wall_s is None:
            self.wall_s = time.monotonic() - self.started
        return True

    def wait(self) -> "BoundedRun":
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.interrupt()
        self.poll()
        return self

    def interrupt(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check(self) -> str:
        """The output, after asserting the run finished in time and succeeded."""
        self.wait()
        what = f"{' '.join(self.cmd[:6])} ... (log: {self.log_path})"
        assert not self.timed_out, f"{what} did not finish in time and was interrupted:\n{self.output[-8000:]}"
        assert self.returncode == 0, f"{what} failed ({self.returncode}):\n{self.output[-10000:]}"
        return self.output
