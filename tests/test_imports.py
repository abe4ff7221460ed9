"""pipeline_lib's modules import one another without a circle: every module can be read, and
imported, after the ones it needs. Function-level imports count too (a circle hidden in a
function still makes each module need the other)."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from conftest import SCRIPTS

def pipeline_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of scripts/pipeline_lib (packages by their
    __init__.py)."""
    out = {}
    for path in sorted((SCRIPTS / "pipeline_lib").rglob("*.py")):
        parts = list(path.relative_to(SCRIPTS).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pipeline_lib modules `name` imports, at any depth of its code."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level else node.module or "")
            for alias in node.names:  # `from . import x` names a module; `from .x import y` an attribute
                sub = f"{base}.{alias.name}"
                found |= {sub} if sub in modules else {base} & set(modules)
    return found - {name}


def import_graph(left_out: tuple[str, ...] = ()) -> dict[str, set[str]]:
    def kept(module: str) -> bool:
        return not any(module == p or module.startswith(p + ".") for p in left_out)

    modules = pipeline_modules()
    return {name: {m for m in imported_modules(name, path, modules) if kept(m)}
            for name, path in modules.items() if kept(name)}


def test_the_graph_sees_top_level_relative_and_function_level_imports():
    graph = import_graph()
    assert "pipeline_lib.secrets" in graph["pipeline_lib.errors"]                 # from .secrets import scrub
    assert "pipeline_lib.errors" in graph["pipeline_lib.training.checkout"]       # from ..errors import ...
    assert "pipeline_lib.generation" in graph["pipeline_lib.traces"]              # inside a function
    assert "pipeline_lib.generation.vllm_backend" in graph["pipeline_lib.generation"]  # from . import x


def test_pipeline_lib_has_no_import_circle():
    try:
        order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import circle in scripts/pipeline_lib: {' -> '.join(err.args[1])}")
    assert order.index("pipeline_lib.secrets") < order.index("pipeline_lib.errors")
