"""Offline bundle (scripts/offline_bundle.py): a real wheel built here by pip, a real sdist
asset, the tiny target and the pipeline's source packed into 64 KiB parts; the parts' sizes and
digests; unpacked and installed with pip --no-index into a venv and into a --target dir, the
package imported and the asset found by pipeline_lib; a corrupted, a missing part and content
that disagrees with the manifest refused with nothing extracted. Nothing is downloaded."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import PY, REPO, build_target

TOOL = REPO / "scripts" / "offline_bundle.py"
PART = 64 * 1024
NAME = "node"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bundle(*args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, str(TOOL), *map(str, args)], text=True, capture_output=True, timeout=600)
    if check and proc.returncode:
        raise AssertionError(f"offline_bundle {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bundle-inputs")
    # Random bytes: xz cannot shrink them, so the wheel alone spans several 64 KiB parts.
    wheel = build_wheel(root, "bundle_probe", os.urandom(150_000), requires="bundle-missing-dep")
    asset = build_wheel(root, "asset_probe", b"data", requires="asset-only-dep")
    sdist = root / "probe_data-0.2.tar.gz"
    (root / "probe_data-0.2").mkdir()
    (root / "probe_data-0.2" / "seed_tasks.jsonl").write_text('{"instruction": "name a colour"}\n')
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(root / "probe_data-0.2", arcname="probe_data-0.2")
    return {"wheel": wheel, "asset": asset, "sdist": sdist, "target": build_target("tiny")}


def build_wheel(root: Path, package: str, blob: bytes, requires: str) -> Path:
    """A real wheel, built by pip from a one-module project (no index, no network)."""
    project = root / package
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text('VALUE = "from the bundle"\n')
    (project / package / "blob.bin").write_bytes(blob)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{package.replace("_", "-")}"\nversion = "0.1"\ndependencies = ["{requires}"]\n'
        f'[tool.setuptools]\npackages = ["{package}"]\n'
        f'[tool.setuptools.package-data]\n{package} = ["*.bin"]\n')
    subprocess.run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    "-w", str(root / "wheels"), str(project)], check=True, capture_output=True)
    (wheel,) = (root / "wheels").glob(f"{package}-0.1-*.whl")
    return wheel


@pytest.fixture(scope="module")
def packed(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle-out") / "bundle"
    bundle("pack", "--out", out, "--name", NAME, "--part-size", "64KiB", "--compression", "xz",
           "--wheel", inputs["wheel"], "--asset-wheel", inputs["asset"], "--sdist", inputs["sdist"], "--target-dir", inputs["target"], "--source", REPO,
           "--env", "VLLM_USE_FLASHINFER_SAMPLER=0", "--download-dir", out.parent / "cache")
    return out


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / f"{NAME}.manifest.json").read_text())


def copy_of(packed: Path, tmp_path: Path) -> Path:
    shutil.copytree(packed, tmp_path / "bundle")
    return tmp_path / "bundle"


def test_parts_have_the_size_and_digests_the_manifest_names(packed, inputs):
    manifest = manifest_of(packed)
    parts = manifest["parts"]
    assert len(parts) >= 4
    on_disk = sorted(p.name for p in packed.glob(f"{NAME}.tar.xz.part-*"))
    assert on_disk == [p["name"] for p in parts]
    for part in parts[:-1]:
        assert (packed / part["name"]).stat().st_size == part["size"] == PART
    assert 0 < (packed / parts[-1]["name"]).stat().st_size == parts[-1]["size"] <= PART
    assert packed.stat().st_mode & 0o777 == 0o777 & ~current_umask()
    for part in parts:
        assert sha256(packed / part["name"]) == part["sha256"]
    whole = hashlib.sha256(b"".join((packed / p["name"]).read_bytes() for p in parts)).hexdigest()
    assert whole == manifest["archive"]["sha256"]
    assert manifest["archive"]["size"] == sum(p["size"] for p in parts)
    # SHA256SUMS checks the parts, the manifest and the unpack script with coreutils alone.
    check = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=packed, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert len(check.stdout.splitlines()) == len(parts) + 2
    files = {f["path"]: f for f in manifest["files"]}
    assert files[f"wheels/{inputs['wheel'].name}"]["sha256"] == sha256(inputs["wheel"])
    assert files[f"sdists/{inputs['sdist'].name}"]["kind"] == "sdist-asset"
    assert files[f"wheels/{inputs['asset'].name}"]["kind"] == "asset-wheel"
    target = inputs["target"]
    for path in target.iterdir():
        assert files[f"target/{target.name}/{path.name}"]["sha256"] == sha256(path)
    assert files["source/Snakefile"]["kind"] == "source"
    assert manifest["tool_version"] >= 1 and manifest["compression"] == "xz"
    assert len(manifest["built_from"]["git_commit"]) == 40
    assert manifest["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def test_unpack_installs_into_a_venv_with_no_index(packed, inputs, tmp_path):
    dest = tmp_path / "node"
    proc = bundle("unpack", packed, "--dest", dest)
    assert "parts checked" in proc.stdout
    # --no-deps installs the set as pinned; what it lacks is reported, not fetched.
    unmet = (dest / "pip-check.txt").read_text()
    assert "bundle-probe 0.1 requires bundle-missing-dep" in unmet and "asset-only-dep" not in unmet
    assert "pip check lists" in proc.stdout
    python = dest / "venv" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import bundle_probe, sys; print(bundle_probe.VALUE); "
                            "print(bundle_probe.__file__); print(sys.prefix)"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert probe[0] == "from the bundle"
    assert Path(probe[1]).is_relative_to(dest / "venv") and Path(probe[2]) == dest / "venv"
    blob = Path(probe[1]).parent / "blob.bin"
    with zipfile.ZipFile(inputs["wheel"]) as wheel:
        assert blob.read_bytes() == wheel.read("bundle_probe/blob.bin")
    # The sdist asset lies where the pipeline's pypi:<name>==<version>/ refs look in that venv.
    found = subprocess.run([str(python), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "from pipeline_lib.assets import resolve_asset; "
                            "print(resolve_asset('pypi:probe-data==0.2/seed_tasks.jsonl'))", str(REPO / "scripts")],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).read_text() == '{"instruction": "name a colour"}\n'
    target = inputs["target"]
    assert sha256(dest / "target" / target.name / "model.safetensors") == sha256(target / "model.safetensors")
    assert "VLLM_USE_FLASHINFER_SAMPLER" in (dest / "env.sh").read_text()
    # Run again: the stamps say it is done; nothing is redone or overwritten.
    again = bundle("unpack", packed, "--dest", dest)
    assert "already holds this bundle" in again.stdout and "installed" not in again.stdout
    # An install that stopped before its stamp is not trusted: the next run installs again.
    (dest / "venv" / ".offline-bundle.json").unlink()
    assert "installed 2 wheels" in bundle("unpack", packed, "--dest", dest).stdout


def test_unpack_into_a_target_dir_and_env_script(packed, tmp_path):
    dest, site = tmp_path / "node", tmp_path / "site"
    bundle("unpack", packed, "--dest", dest, "--target", site, "--python", PY)
    assert (site / "bundle_probe" / "__init__.py").is_file()
    out = subprocess.run(["bash", "-c", f"source {dest / 'env.sh'} && python -c \"import bundle_probe, sys; "
                          f"sys.path.insert(0, '{REPO / 'scripts'}'); "
                          f"from pipeline_lib.assets import resolve_asset; print(bundle_probe.__file__); "
                          f"print(resolve_asset('pypi:probe-data==0.2/seed_tasks.jsonl'))\""],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert Path(out[0]).is_relative_to(site)
    assert Path(out[1]).is_relative_to(site / "share" / "pypi-sdists")
    # Rules call `python`: env.sh puts one first on PATH that is the interpreter given to unpack.
    which = subprocess.run(["bash", "-c", f"source {dest / 'env.sh'} && python -c 'import sys; print(sys.prefix)'"],
                           capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip()
    assert which == subprocess.run([PY, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                   text=True, check=True).stdout.strip()


def assert_nothing_extracted(dest: Path) -> None:
    assert not dest.exists()
    assert not list(dest.parent.glob(f".{dest.name}.partial-*"))


def test_a_corrupted_part_is_refused_naming_it(packed, tmp_path):
    folder = copy_of(packed, tmp_path)
    part = folder / manifest_of(folder)["parts"][1]["name"]
    data = bytearray(part.read_bytes())
    data[1000] ^= 0x01
    part.write_bytes(bytes(data))
    dest = tmp_path / "node"
    proc = bundle("unpack", folder, "--dest", dest, check=False)
    assert proc.returncode == 2
    assert f"part {part.name} is corrupted" in proc.stderr and "copy the named part(s) again" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert_nothing_extracted(dest)
    assert bundle("verify", folder, check=False).returncode == 2


def test_a_missing_and_a_short_part_are_refused_naming_them(packed, tmp_path):
    folder = copy_of(packed, tmp_path)
    parts = manifest_of(folder)["parts"]
    last, first = folder / parts[-1]["name"], folder / parts[0]["name"]
    last.unlink()
    first.write_bytes(first.read_bytes()[:-100])  # a copy cut short
    dest = tmp_path / "node"
    proc = bundle("unpack", folder, "--dest", dest, check=False)
    assert proc.returncode == 2
    assert f"part {last.name} is missing from {folder}" in proc.stderr
    assert f"part {first.name} has {PART - 100} bytes, the manifest says {PART}" in proc.stderr
    assert_nothing_extracted(dest)


def test_content_that_disagrees_with_the_manifest_is_not_kept(packed, tmp_path):
    """Parts intact but a file's recorded digest differs: extraction runs, the file check
    refuses, and the temp dir is removed instead of becoming --dest."""
    folder = copy_of(packed, tmp_path)
    path = folder / f"{NAME}.manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    dest = tmp_path / "node"
    proc = bundle("unpack", folder, "--dest", dest, check=False)
    assert proc.returncode == 2
    assert f"{manifest['files'][0]['path']}: sha256 differs from the manifest" in proc.stderr
    assert_nothing_extracted(dest)


def test_pack_refuses_an_unpinned_requirement_and_an_existing_out(tmp_path):
    reqs = tmp_path / "node.txt"
    reqs.write_text("# node wheels\nvllm==0.26.0\nfastapi<0.137\n")
    proc = bundle("pack", "--out", tmp_path / "b", "--requirements", reqs, "--download-dir", tmp_path / "c", check=False)
    assert proc.returncode == 2 and f"{reqs}:3: 'fastapi<0.137' is not pinned" in proc.stderr
    plan = bundle("pack", "--out", tmp_path / "b", "--dry-run", "--wheel", reqs).stdout
    assert f"{reqs.stat().st_size / 1e6:10.2f} MB  node.txt" in plan and not (tmp_path / "b").exists()
    (tmp_path / "b").mkdir()
    proc = bundle("pack", "--out", tmp_path / "b", "--wheel", reqs, check=False)
    assert proc.returncode == 2 and "exists; a bundle is never overwritten" in proc.stderr
