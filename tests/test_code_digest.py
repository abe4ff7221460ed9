"""The code digest every rule carries (rules/common.smk code_version): the text scan that finds
a program's library imports finds what Python's parser finds, in every file of scripts/."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import SCRIPTS
from pipeline_lib import code_digest


def parsed_import_froms(source: str) -> list[tuple[int, str, list[str]]]:
    """The reference: every ImportFrom node of the parsed source, in source order."""
    nodes = sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)),
                   key=lambda n: (n.lineno, n.col_offset))
    return [(n.level, n.module or "", [a.name for a in n.names]) for n in nodes]


def all_sources() -> list[Path]:
    return sorted(p for p in SCRIPTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_scan_finds_every_import_the_parser_finds():
    sources = all_sources()
    assert len(sources) > 100
    differ = [str(p.relative_to(SCRIPTS)) for p in sources
              if code_digest.import_froms(p.read_text()) != parsed_import_froms(p.read_text())]
    assert not differ, f"the import scan and ast disagree on: {differ}"


def test_statement_forms():
    source = ("from .a import (\n    b,  # why\n    c as d,\n)\n"
              "from ..e.f import g, \\\n    h\n"
              "def x():\n    from pipeline_lib import io as i\n"
              "import os\n")
    assert code_digest.import_froms(source) == parsed_import_froms(source) == [
        (1, "a", ["b", "c"]), (2, "e.f", ["g", "h"]), (0, "pipeline_lib", ["io"])]


def test_a_program_reaches_the_modules_it_imports_and_no_others(tmp_path):
    lib = tmp_path / "pipeline_lib"
    (lib / "pkg").mkdir(parents=True)
    for rel, text in {"__init__.py": "", "used.py": "from .pkg import leaf\n", "unused.py": "",
                      "pkg/__init__.py": "", "pkg/leaf.py": "from ..deep import x\n",
                      "deep.py": "x = 1\n"}.items():
        (lib / rel).write_text(text)
    (tmp_path / "prog.py").write_text("from pipeline_lib.used import y\nfrom pipeline_lib import unused2\n")
    files = {p.relative_to(tmp_path).as_posix() for p in code_digest.code_files(tmp_path, "prog.py")}
    assert files == {"prog.py", "pipeline_lib/__init__.py", "pipeline_lib/used.py", "pipeline_lib/pkg/__init__.py",
                     "pipeline_lib/pkg/leaf.py",
                     "pipeline_lib/deep.py"}
    before = code_digest.code_version(tmp_path, "prog.py")
    (lib / "unused.py").write_text("changed = True\n")
    assert code_digest.code_version(tmp_path, "prog.py") == before
    (lib / "deep.py").write_text("x = 2\n")
    assert code_digest.code_version(tmp_path, "prog.py") != before
