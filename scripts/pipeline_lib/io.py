"""File writes that never leave a half-written file under its final name; text inputs read as
strict UTF-8; full disks reported as such."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import PipelineError


def _tmp_sibling(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; artifacts should get the usual umask-derived mode (shared clusters).
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    return Path(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    with disk_full_guard(path):
        tmp = _tmp_sibling(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    path = Path(path)
    n = 0
    with disk_full_guard(path):
        tmp = _tmp_sibling(path)
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
                    n += 1
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return n


class atomic_dir:
    """Build a directory under a temporary name, rename it into place on success.

        with atomic_dir(out) as tmp:
            write files into tmp
    An existing directory at `out` is replaced only after the new one is complete."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(self.tmp, 0o777 & ~mask)  # mkdtemp makes 0700; results are shared on clusters
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.path, old)
            os.replace(self.tmp, self.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.path)
        return False


UTF8_BOM = b"\xef\xbb\xbf"


def decode_text(data: bytes, where: str, first_line: int = 1, first_offset: int = 0) -> str:
    """UTF-8 text with a leading byte-order mark dropped (what Windows editors write). Bytes
    that are not UTF-8 raise an error naming `where`, the line, the column and the byte
    offset; `first_line`/`first_offset` place `data` inside a larger file."""
    if first_offset == 0 and data.startswith(UTF8_BOM):
        data, first_offset = data[len(UTF8_BOM):], len(UTF8_BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        bad = data[err.start:err.end].hex(" ")
        raise PipelineError(
            f"{where}:{line}: not UTF-8 text (byte(s) {bad} at byte offset {first_offset + err.start}, "
            f"column {column}: {err.reason}); save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A text input (prompt file, config, settings file) as str; see decode_text."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PipelineError(f"{path}: {what} not found") from None
    return decode_text(data, str(path))


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield (line_number, row); a malformed line raises an error naming file and line (and
    the byte offset of bytes that are not UTF-8). A leading byte-order mark is skipped."""
    path = Path(path)
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = decode_text(raw, str(path), lineno, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PipelineError(
                    f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                    f"fix or remove that line"
                ) from None
            if not isinstance(row, dict):
                raise PipelineError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            yield lineno, row


def append_jsonl_durable(f, row: dict) -> None:
    """Append one row and fsync, so a killed job keeps every row it reported as done (a torn
    last line, from a kill or a full disk, is skipped by the readers of such logs)."""
    with disk_full_guard(Path(f.name)):
        f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    path = Path(path)
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PipelineError(f"{path}:{err.lineno}: {what} is not valid JSON ({err.msg} at column "
                            f"{err.colno})") from None


def get_in(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]...; None where a level is missing or not a dict (reports read optional,
    nested sections of verification.json this way)."""
    for k in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(k)
    return obj


# --------------------------------------------------------------------------- full disks

# No space, quota exceeded, or a file over the filesystem's / the process's (ulimit -f) limit.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFull(PipelineError):
    """A write failed for want of space; `reason` is the OS's word for it."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@contextmanager
def disk_full_guard(path: Path):
    """A full disk while writing `path` becomes a DiskFull naming it (the writers above use
    this, so a full disk is never a bare OSError traceback)."""
    try:
        yield
    except OSError as err:
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        reason = os.strerror(err.errno)
        raise DiskFull(f"{path}: {reason} ({human_bytes(free_bytes(path))} free); free space and rerun",
                       reason) from None


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human_bytes(n: float | None) -> str:
    """A byte count for messages (decimal units). Here, not in plan.py: every rule's program
    imports this module, and a rule's code version covers what it imports, so importing the
    planner from here made an edit to a plan-time check rerun every rule."""
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"


def require_free_space(path: str | os.PathLike, needed: int, what: str) -> None:
    """Fail before starting work that cannot fit: `what` needs `needed` bytes under `path`."""
    free = free_bytes(path)
    if needed > free:
        raise PipelineError(
            f"{path}: not enough disk space for {what}: the plan expects {human_bytes(needed)} ({needed:,} bytes), "
            f"{human_bytes(free)} is free there. Free space (or move results/ to a bigger disk) and rerun; "
            f"nothing was written")


def _disk_full_cause(err: BaseException, path: str | os.PathLike, smallest_write: int) -> str | None:
    """Why `err` means the disk is full, or None. Writers inside libraries (torch.save,
    safetensors, a vLLM engine process) often lose the errno, so a failure while the
    filesystem has less free space than the write needed counts as well."""
    if isinstance(err, DiskFull):
        return err.reason
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return os.strerror(seen.errno)
        # Rust writers (safetensors' save_file) report the errno only in their message.
        rust_io = re.search(r"\(os error (\d+)\)", str(seen))
        if rust_io and int(rust_io.group(1)) in DISK_FULL_ERRNOS:
            return os.strerror(int(rust_io.group(1)))
        seen = seen.__cause__ or seen.__context__
    free = free_bytes(path)
    if free < smallest_write:
        return f"{type(err).__name__}: {str(err)[:300]}, with {human_bytes(free)} left on the device"
    return None


@contextmanager
def reporting_disk_full(path: str | os.PathLike, what: str, expected: int, smallest_write: int, resume: str):
    """Turn a write failure on a full disk inside the block into an error that names `path`,
    what was being written, the bytes the plan expected (`expected`) and how to resume.
    `smallest_write`: bytes of the smallest unit written (one file, one checkpoint)."""
    try:
        yield
    except Exception as err:  # a torchrun worker's failure arrives as a PipelineError too
        cause = _disk_full_cause(err, path, smallest_write)
        if cause is None:
            raise
        raise PipelineError(
            f"{path}: the disk is full ({cause}) while writing {what}; the plan expected {human_bytes(expected)} "
            f"({expected:,} bytes) for it, {human_bytes(free_bytes(path))} is free now. Nothing half-written was "
            f"kept under a final name. Free space (or move results/ to a bigger disk) and rerun: {resume}") from None
