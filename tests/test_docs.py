"""The documentation: the generated pages (docs/configuration.md from the config schema, the tables
of docs/*.md from bench/results/) match what scripts/make_docs.py makes of the committed
sources, so CI fails on a stale page; and every relative link in README.md and docs/*.md leads to
a file (and heading) that exists. Cheap: no engine, no pipeline run."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import make_docs  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_generated_pages_are_up_to_date():
    stale = [str(p.relative_to(REPO)) for p in make_docs.stale_pages()]
    assert not stale, f"stale generated docs: {', '.join(stale)}; run `make docs` and commit them"


def test_a_hand_edited_generated_page_is_named_as_stale(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    monkeypatch.setattr(make_docs, "DOCS", docs)
    monkeypatch.setattr(make_docs, "CONFIG_PAGE", docs / "configuration.md")
    assert make_docs.stale_pages() == []
    page = docs / "configuration.md"
    page.write_text(page.read_text().replace("| `train.epochs` | integer, >= 1 | `10` |",
                                             "| `train.epochs` | integer, >= 1 | `12` |"))
    results = docs / "results.md"
    results.write_text(results.read_text().replace("1.89 (1.81-1.97), 80", "1.95 (1.81-1.97), 80", 1))
    assert make_docs.stale_pages() == [page, results]


def schema_keys(node: dict, root: dict, path: str):
    """Every dotted key of the schema, through $ref/allOf, list items and named entries."""
    node = make_docs.resolve(node, root)
    yield path
    for branch in [node] + [make_docs.resolve(node[b], root) for b in ("then", "else") if b in node]:
        for name, sub in (branch.get("properties") or {}).items():
            yield from schema_keys(sub, root, f"{path}.{name}")
        items = branch.get("items")
        if isinstance(items, dict):
            for name, sub in (make_docs.resolve(items, root).get("properties") or {}).items():
                yield from schema_keys(sub, root, f"{path}[].{name}")
        extra = branch.get("additionalProperties")
        if isinstance(extra, dict):
            for name, sub in (make_docs.resolve(extra, root).get("properties") or {}).items():
                yield from schema_keys(sub, root, f"{path}.<name>.{name}")


def test_configuration_page_has_every_schema_key_with_its_default():
    root = yaml.safe_load(make_docs.SCHEMA.read_text())
    page = make_docs.configuration_page()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", page, re.M)}
    keys = [k for name, node in root["properties"].items() for k in schema_keys(node, root, name)]
    # A section's own row is its paragraph; a list item's key given as a lone source too is
    # listed once (prompts.train[].source = prompts.train.source).
    missing = [k for k in keys if k not in rows and k not in root["properties"] and k.replace("[]", "") not in rows]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"
    assert "| `train.epochs` | integer, >= 1 | `10` |" in rows["train.epochs"]
    assert "`1000`" in rows["verify.bootstrap.samples"]
    # Keys follow the schema's order.
    order = [k for k in keys if k in rows]
    assert order == sorted(order, key=list(rows).index)


def test_results_tables_recompute_the_recorded_figures():
    """The acceptance table is recomputed from per-prompt records: it must agree with what the
    run's own account recorded (bench/results/gpu-recipe-2026-12-04d.md: MT-Bench 1.89 (1.81-1.97))."""
    table = make_docs.recipe_acceptance(make_docs.BENCH_RESULTS)
    row = next(line for line in table.splitlines() if "gpu-recipe-2026-12-04d.acceptance.json" in line)
    assert "1.89 (1.81-1.97), 80" in row and "2.34 (2.22-2.46), 24" in row
    assert "1.89 (1.81-1.97)" in (make_docs.BENCH_RESULTS / "gpu-recipe-2026-12-04d.md").read_text()


def test_a_measured_run_without_a_description_is_refused(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(make_docs.BENCH_RESULTS, results)
    shutil.copy(results / "gpu-recipe-2026-12-04d.acceptance.json", results / "gpu-recipe-2026-12-05.acceptance.json")
    with pytest.raises(ValueError, match=r"gpu-recipe-2026-12-05.acceptance.json: no description .*make docs"):
        make_docs.recipe_acceptance(results)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group(0) == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("GPU stages against the hardware's limits (H200, 2026-12-03)") == \
        "gpu-stages-against-the-hardwares-limits-h200-2026-12-03"
    assert slug("CPU demo (`make demo`)") == "cpu-demo-make-demo"
    assert slug("hidden_states") == "hidden_states"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"
