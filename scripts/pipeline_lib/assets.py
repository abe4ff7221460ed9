"""Resolve `pypi:<package>/<path>` references to files shipped inside installed packages.

The demo's model and prompt sets come from PyPI packages that must not be imported (their
imports pull in unrelated CLIs); find_spec locates them without importing."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "pypi:"


def resolve_asset(ref: str | None) -> str:
    if ref is None:
        raise FileNotFoundError("no path given")
    if not ref.startswith(PREFIX):
        return ref
    package, _, inner = ref[len(PREFIX):].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{ref}: Python package '{package}' is not installed; run `make env` "
            f"(it installs the demo assets listed in envs/assets.txt)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / inner
    if not path.exists():
        raise FileNotFoundError(f"{ref}: no file {inner} inside package {package} ({path})")
    return str(path)


def is_remote_ref(ref: str) -> bool:
    """True for hub ids (org/name) that are neither local paths nor pypi: refs."""
    return not ref.startswith(PREFIX) and not Path(ref).exists() and ref.count("/") == 1
