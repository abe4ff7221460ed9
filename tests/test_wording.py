"""The repository speaks of the product, not of how the work on it was organised: no tracker
numbers ("issue 28", "issue #12, ask 4"), no names for the machines work happened to run on
("the CPU box", "the lent H200") or for the way they were reached ("one device call", the
copy-in and result folders /tmp/carry, /tmp/res, $OUT/recipe.tgz, "the run's GPU time budget").
A run is named by its date, hardware and configuration. Every file git tracks or would track
(untracked, not ignored) is read, so a new file is checked before it is committed; a hit fails
with its file:line. Raw program output kept as a record (the non-Markdown files of bench/results/:
logs and JSON the tools wrote) is exempt from the rules about paths only: the paths in them are
what the tools printed on that machine."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()
# Walked only where git is missing (a source tarball): what .gitignore keeps out of the tree.
IGNORED_DIRS = {".git", ".venv", "results", ".snakemake", ".cache", ".work", "__pycache__", ".whl", "bundle"}

# (name, pattern, applies to raw tool output too, a line it must catch, a line it must let pass)
RULES = [
    ("tracker number", r"(?<![\w/-])issues?\s+#?\d+",
     True, "Ablation (issue #12, ask 4): does a draft", "see https://github.com/vllm-project/vllm/issues/123"),
    ("lent machine", r"\blent\b",
     True, "The lent H200 box: CPython 3.12", "a silent failure"),
    ("'box' for a machine", r"\bbox(es|'s)?\b(?!\s*plot)",
     True, "Measured on the CPU box (2 cores)", 'fig.savefig(buf, bbox_inches="tight")'),
    ("device call or time", r"\bdevice\s+(calls?|time|budget)\b",
     True, "Run by bench/gpu_recipe.sh (one device call)", "the device the stage runs on"),
    ("time budget of a run", r"\b(gpu|device)\s+time\s+budget\b",
     True, "the run's GPU time budget (30 minutes) ended first", "the demo's 20-minute budget"),
    ("numbered session", r"\bsession\s+\d+\b",
     True, "transformers 5.17.0, 2026-12-04 (session 4)", "=== test session starts ==="),
    ("brief", r"\bthe\s+brief\b|\bbrief's\b",
     True, '"""The brief\'s case: Snakemake counts gpu=2', '"system": "Be brief."'),
    ("copy-in or result folder", r"/tmp/(carry|res)\b",
     False, "It expects under /tmp/carry/ what was copied", "BENCH_SMOKE=1 python x.py --out /tmp/speedup"),
    ("output folder of a remote call", r"\$OUT/recipe\.tgz",
     False, "packs them into `$OUT/recipe.tgz`", 'OUT="$W/results/gpu-bench"'),
    ("interpreter-specific install path", r"python3\.\d+/site-packages",
     False, "(`.venv/lib/python3.11/site-packages/`)", "the venv's `site-packages`"),
]
COMPILED = [(name, re.compile(pattern, re.I), raw_too) for name, pattern, raw_too, _, _ in RULES]


def repository_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True).stdout
        return sorted({p for p in out.decode().split("\0") if p})
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
                      if p.is_file() and not IGNORED_DIRS & set(p.relative_to(REPO).parts[:-1]))


def raw_output(path: str) -> bool:
    return path.startswith("bench/results/") and not path.endswith(".md")


def hits(path: str, text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.split("\n"), 1):
        for name, pattern, raw_too in COMPILED:
            if (raw_too or not raw_output(path)) and (m := pattern.search(line)):
                found.append(f"{path}:{number}: {name}: {m.group(0)!r} in {line.strip()[:160]!r}")
    return found


@pytest.mark.parametrize("name, pattern, raw_too, caught, passed", RULES, ids=[r[0] for r in RULES])
def test_each_rule_catches_its_example_and_passes_its_counterexample(name, pattern, raw_too, caught, passed):
    assert re.search(pattern, caught, re.I), f"{name}: {pattern} misses {caught!r}"
    assert not re.search(pattern, passed, re.I), f"{name}: {pattern} flags {passed!r}"


def test_no_file_uses_words_of_how_the_work_was_organised():
    files = repository_files()
    assert "README.md" in files and "config.yaml" in files and THIS in files, files[:20]
    found, read = [], 0
    for path in files:
        if path == THIS:  # its rules and examples are the words themselves
            continue
        full = REPO / path
        if not full.is_file():  # deleted in the work tree, not yet in the index
            continue
        data = full.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        read += 1
        found += hits(path, data.decode("utf-8", errors="replace"))
    assert read > 100, f"read only {read} text files"
    assert not found, ("words of how the work was organised, not of the product (describe runs by date, "
                       "hardware and config):\n" + "\n".join(found))


def test_a_planted_word_is_named_with_its_file_and_line():
    text = "# fine\nMeasured 2026-12-04 on the CPU box.\n"
    assert hits("docs/x.md", text) == [
        "docs/x.md:2: 'box' for a machine: 'box' in 'Measured 2026-12-04 on the CPU box.'"]
    # A raw log keeps the paths its tool printed, not the words around them.
    assert hits("bench/results/x.log", "wrote /tmp/res/a.json") == []
    assert hits("bench/results/x.md", "wrote /tmp/res/a.json") != []
