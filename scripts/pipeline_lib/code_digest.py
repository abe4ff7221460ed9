"""The code a rule runs: its program and the library modules it imports, transitively, and a
digest of them (rules/common.smk `code_version()`, a param of every rule). Editing a program or a
module it uses reruns the rule; editing a module it does not use reruns nothing.

Imports are found by scanning the source text, not by parsing it: every Snakemake run (each
dry-run, each cluster job) digests every rule's code, and parsing the ~120 files cost each run
0.3 s. The scan sees the `from X import a, b` statements the parser sees
(tests/test_code_digest.py holds it to `ast` over every file of scripts/); a statement written
at the start of a line inside a string is taken too, which at worst counts a module as used."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

# `from <dots><module> import <names>`: names up to the end of the line, across backslash
# continuations, or a parenthesized list across lines.
IMPORT_FROM = re.compile(
    r"^[ \t]*from[ \t]+(?P<dots>\.*)(?P<module>[\w.]*)[ \t]+import[ \t]*"
    r"(?P<names>\([^)]*\)|(?:[^\n\\]|\\\n)*)", re.M)
LIBRARY = "pipeline_lib"


def import_froms(source: str) -> list[tuple[int, str, list[str]]]:
    """(level, module, imported names) of each `from ... import ...` statement in `source`;
    module is "" for `from . import x`, level the number of leading dots."""
    found = []
    for m in IMPORT_FROM.finditer(source):
        names = re.sub(r"#[^\n]*", "", m["names"]).replace("\\\n", " ").strip("() \t\n")
        found.append((len(m["dots"]), m["module"],
                      [n.split()[0] for n in re.split(r"[,\n]", names) if n.strip()]))
    return found


def _module_files(base: Path, dotted: str) -> list[Path]:
    """The file(s) of module `dotted` under `base`: a module file or a package's __init__."""
    target = base.joinpath(*dotted.split(".")) if dotted else base
    return [f for f in (target.with_suffix(".py"), target / "__init__.py") if f.is_file()]


def direct_imports(path: Path, scripts: Path) -> list[Path]:
    """Library files `path` imports itself: `from pipeline_lib.x import y`, `from pipeline_lib
    import x`, and relative imports inside the library at any depth."""
    lib = scripts / LIBRARY
    files = []
    for level, module, names in import_froms(path.read_text()):
        if level:  # relative: only meaningful inside the library
            if lib not in path.parents:
                continue
            base = path.parent
            for _ in range(level - 1):
                base = base.parent
            dotted = module
        elif module == LIBRARY or module.startswith(LIBRARY + "."):
            base, dotted = lib, module.partition(".")[2]
        else:
            continue
        files += _module_files(base, dotted)
        package = base.joinpath(*dotted.split(".")) if dotted else base
        for name in names:  # `from package import submodule`
            files += _module_files(package, name)
    return files


def code_files(scripts: Path, *programs: str) -> set[Path]:
    """The programs (named relative to `scripts`) and every library file they reach."""
    seen = {scripts / p for p in programs}
    todo = list(seen)
    while todo:
        for dep in direct_imports(todo.pop(), scripts):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def code_version(scripts: Path, *programs: str) -> str:
    """Content digest of code_files(); files are named relative to `scripts`, so where the
    checkout lives (another path, a second clone) never changes it."""
    h = hashlib.sha256()
    for p in sorted(code_files(scripts, *programs)):
        h.update(p.relative_to(scripts).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]
