"""The checkout speculators runs from: recorded by commit and digest, its diff never copied.

speculators 0.9.0 saves `git diff HEAD` of the git checkout its package lives in as
`speculators.patch` next to the checkpoints whenever that checkout has uncommitted changes
(speculators/train/utils.py). With `make env` that checkout is the pipeline's own (.venv sits
inside it), so a user's uncommitted edits - credentials among them - would be copied into every
checkpoint and whatever is published from it. Scrubbing cannot know every secret an edit may
hold, so the patch is not written at all; provenance keeps what reproducing a run needs: the
commit, whether the tree was dirty, and the sha256 of the diff (`git diff HEAD | sha256sum`)."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

from ..errors import PipelineError
from ..speculators_cpu import installed_version

PATCH_FILE = "speculators.patch"


def _skip_patch(save_dir: Path, repo_root: Path | None, sha: str) -> None:
    """Stands in for speculators' _save_speculators_patch: nothing is written."""


def suppress_patch() -> None:
    """Stop speculators writing PATCH_FILE in this process (call before it trains or saves)."""
    import speculators.train.utils as utils

    if not hasattr(utils, "_save_speculators_patch"):
        raise PipelineError(
            f"speculators {installed_version()} has no train.utils._save_speculators_patch, which this pipeline "
            f"replaces so that no `git diff` of uncommitted edits (credentials among them) is saved into "
            f"checkpoints; check how this version writes {PATCH_FILE} and update "
            f"pipeline_lib/training/checkout.py")
    utils._save_speculators_patch = _skip_patch


def remove_patches(root: Path) -> list[Path]:
    """Delete PATCH_FILE copies under `root` that an earlier speculators run left there."""
    found = sorted(root.rglob(PATCH_FILE)) if root.is_dir() else []
    for path in found:
        path.unlink()
    return found


def checkout_state() -> dict[str, Any]:
    """The checkout speculators would have diffed (its own lookup: the nearest .git above its
    package): path, commit, dirty flag and sha256 of `git diff HEAD`; None where not a checkout."""
    import speculators.train.utils as utils
    from speculators.provenance import find_repo_root

    root = find_repo_root(Path(utils.__file__))
    state: dict[str, Any] = {"path": str(root) if root else None, "commit": None, "dirty": None,
                             "diff_sha256": None}
    if root is None:
        return state
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=20)
        diff = subprocess.run(["git", "-C", str(root), "diff", "HEAD"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return state
    if head.returncode == 0 and diff.returncode == 0:
        state.update(commit=head.stdout.strip(), dirty=bool(diff.stdout.strip()),
                     diff_sha256=hashlib.sha256(diff.stdout).hexdigest())
    return state

