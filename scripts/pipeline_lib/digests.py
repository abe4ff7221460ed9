"""Content digests. Big directories are summarised once by the rule that writes them (their
provenance records `outputs[*].digest`); downstream rules reuse that instead of rehashing."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CHUNK = 8 << 20


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def dir_manifest(path: str | os.PathLike, skip_hidden: bool = True) -> dict[str, str]:
    """{relative path: sha256} for every file under `path` (sorted, hidden files skipped)."""
    root = Path(path)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if skip_hidden and any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file():
            out[str(rel)] = file_digest(p)
    return out


def manifest_digest(manifest: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def path_digest(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.is_dir():
        return manifest_digest(dir_manifest(p))
    return file_digest(p)


def json_digest(obj: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def text_digest(text: str | None) -> str | None:
    if text is None:
        return None
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
