"""envs/cpu.lock, what `make env` installs on a machine without a GPU: every package pinned, in
agreement with envs/cpu.txt, without the packages the CPU stack must not have, and installed
as it is in the environment these tests run in."""
from __future__ import annotations

import importlib.metadata
import re
import sys
import sysconfig

from conftest import REPO

def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path) -> list[tuple[str, str | None]]:
    """(name, pinned version or None) of each requirement line."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out.append((canonical(re.split(r"[<>=!~\[; ]", name)[0]), version.strip() or None))
    return out


# The packages the CPU stack must not have (envs/cpu-exclude.txt says why).
EXCLUDED = {name for name, _ in requirements(REPO / "envs" / "cpu-exclude.txt")}


def test_the_lock_pins_every_package_of_cpu_txt_at_its_version():
    lock = dict(requirements(REPO / "envs" / "cpu.lock"))
    assert len(lock) > 150 and all(lock.values()), "every line of envs/cpu.lock is name==version"
    for name, version in requirements(REPO / "envs" / "cpu.txt"):
        assert name in lock, f"{name} (envs/cpu.txt) is not in envs/cpu.lock: run `make lock`"
        if version:
            assert lock[name] == version, f"{name}: envs/cpu.txt pins {version}, envs/cpu.lock {lock[name]}: run `make lock`"
    assert not EXCLUDED & lock.keys()


def test_this_environment_is_the_lock():
    if sys.prefix == sys.base_prefix:
        raise AssertionError("the tests run in the pipeline's venv (`make test`), not a system Python")
    differ = {}
    for name, version in requirements(REPO / "envs" / "cpu.lock"):
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            differ[name] = (version, have)
    assert not differ, f"installed differently from envs/cpu.lock (locked, installed): {differ}; run `make env`"
    # The venv's site-packages only: once setuptools is imported (torch does), its vendored
    # packages' metadata is on sys.path too, and they are not installed packages.
    site = sysconfig.get_path("purelib")
    present = {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions(path=[site])}
    assert not EXCLUDED & present
    # Everything else installed came from the lock, or from the two lists installed after it.
    extra = {name for f in ("slurm-plugin.txt", "assets.txt") for name, _ in requirements(REPO / "envs" / f)}
    unlocked = present - {name for name, _ in requirements(REPO / "envs" / "cpu.lock")} - extra - {"pip"}
    assert not unlocked, f"installed but not in envs/cpu.lock: {sorted(unlocked)}; run `make lock`"
