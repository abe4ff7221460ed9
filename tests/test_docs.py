"""The documentation: the generated pages (docs/configuration.md from the config schema, the
README's current figures and the tables of docs/*.md from bench/results/) match what
scripts/make_docs.py makes of the committed sources, so CI fails on a stale page or a hand-edited
figure; every relative link in README.md and docs/*.md, and every `docs/<page>.md#<anchor>` the
configs and code cite, leads to a file (and heading) that exists; the README is at most 350 lines,
its own-target path (GPU node, then SLURM) ahead of the demo and the tests; docs/testing.md's table names
every test file; config.yaml sets or names every key of its sections. Cheap: no engine, no
pipeline run."""
from __future__ import annotations

import json
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
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    monkeypatch.setattr(make_docs, "DOCS", docs)
    monkeypatch.setattr(make_docs, "CONFIG_PAGE", docs / "configuration.md")
    monkeypatch.setattr(make_docs, "README", tmp_path / "README.md")
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


def broken_target(page: Path, target: str) -> str | None:
    """Why a relative link from `page` leads nowhere (no such file, no such heading), or None."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target} (no such file)"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target} (no heading #{anchor} in {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})"
    return None


def broken_links(page: Path) -> list[str]:
    targets = [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z]+:", t)]
    return [why for t in targets if (why := broken_target(page, t))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_a_link_to_a_missing_section_is_caught(tmp_path):
    """A section link is checked against the headings of the page it names: a renamed or moved
    section (a pointer to a README section that lives in results.md) is caught."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Known problems\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#known-problems), [gone](docs/a.md#tuning-the-demo), [self](#a-readme), "
                    "[here, gone](#tuning), [no file](docs/b.md)\n\n# A README\n")
    assert broken_links(page) == [f"docs/a.md#tuning-the-demo (no heading #tuning-the-demo in {docs / 'a.md'})",
                                  f"#tuning (no heading #tuning in {page})", "docs/b.md (no such file)"]


# Plain-text references to a page's section in the configs and code (`docs/x.md#anchor`, as a
# config comment gives them): checked like links, relative to the repository.
TEXT_REF = re.compile(r"(?<![\w/.-])((?:docs/)?[\w.-]+\.md)#([\w-]+)")
CODE = [REPO / "config.yaml", REPO / "Snakefile", REPO / "Makefile", *sorted((REPO / "configs").glob("*.yaml")),
        *sorted((REPO / "rules").glob("*.smk")), *sorted((REPO / "scripts").rglob("*.py")),
        *sorted((REPO / "bench").glob("*.py")), *sorted((REPO / "bench").glob("*.sh"))]


def broken_text_refs(text: str) -> list[str]:
    out = []
    for m in TEXT_REF.finditer(text):
        page = REPO / m.group(1)
        if not page.exists():
            out.append(f"{m.group(0)} (no such file)")
        elif m.group(2) not in anchors(page):
            out.append(f"{m.group(0)} (no heading #{m.group(2)} in {m.group(1)})")
    return out


def test_section_references_in_configs_and_code_resolve():
    assert TEXT_REF.search((REPO / "config.yaml").read_text()), "config.yaml cites a section as docs/<page>.md#<anchor>"
    broken = {}
    for f in CODE:
        if f.is_file() and (why := broken_text_refs(f.read_text(errors="replace"))):
            broken[str(f.relative_to(REPO))] = why
    assert not broken, f"section references that lead nowhere: {broken}"
    assert broken_text_refs("see docs/results.md#tuning-the-demo and README.md#current-figures") == \
        ["docs/results.md#tuning-the-demo (no heading #tuning-the-demo in docs/results.md)"]


# ------------------------------------------------------------- the figures, one source for each


def headline_rows(text: str) -> dict[str, list[str]]:
    """The headline table (of a page's generated block, or as make_docs writes it): row label ->
    its cells."""
    block = re.search(r"<!-- BEGIN GENERATED: headline -->\n(.*?)<!-- END GENERATED: headline -->", text, re.S)
    rows = [line.strip("|").split(" | ") for line in (block.group(1) if block else text).splitlines()
            if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_readme_and_results_show_the_same_generated_figures():
    readme, results = (REPO / "README.md").read_text(), (REPO / "docs" / "results.md").read_text()
    for page in (readme, results):
        assert "<!-- BEGIN GENERATED: headline -->" in page
    assert "<!-- BEGIN GENERATED: prompt-sources -->" in results  # the README links it there
    # the same cells, links aside (the README links bench/results/, results.md ../bench/results/)
    assert headline_rows(readme.replace("](bench/results/", "](../bench/results/")) == headline_rows(results)


def test_a_hand_edited_figure_is_named_as_stale(tmp_path, monkeypatch):
    """A figure typed into the README's table or results.md's headline (instead of a record added
    to bench/results/ and `make docs`) fails the check."""
    docs, readme = tmp_path / "docs", tmp_path / "README.md"
    shutil.copytree(REPO / "docs", docs)
    shutil.copy(REPO / "README.md", readme)
    monkeypatch.setattr(make_docs, "DOCS", docs)
    monkeypatch.setattr(make_docs, "CONFIG_PAGE", docs / "configuration.md")
    monkeypatch.setattr(make_docs, "README", readme)
    assert make_docs.stale_pages() == []
    text = readme.read_text()
    gpu_tau = headline_rows(text)["τ MT-Bench (80), 95% interval"][1]
    readme.write_text(text.replace(f"| {gpu_tau} |", "| 1.99 (1.90-2.05) |", 1))
    assert make_docs.stale_pages() == [readme]
    results = docs / "results.md"
    suite = next(v for k, v in headline_rows(results.read_text()).items() if k.startswith("test suite"))[0]
    results.write_text(results.read_text().replace(suite, suite.replace(" passed", "0 passed", 1), 1))
    assert make_docs.stale_pages() == [readme, results]


def test_headline_figures_are_the_records(tmp_path):
    """Each cell comes from the newest record of its kind: the CPU demo's from the newest
    demo-*.run.json, the GPU recipe's from the same acceptance.json the recipe table reads, the
    test suite's from the newest CI log. A newer record takes over its column."""
    results = make_docs.BENCH_RESULTS
    rows = headline_rows(make_docs.headline(results))
    _, demo = make_docs.demo_records(results)[-1]
    assert rows["date, hardware"][0].startswith(f"{demo['date']}, {demo['hardware']}, commit {demo['commit']}")
    assert rows["epochs / time"][0].startswith(f"{demo['epochs']} / {make_docs.duration(demo['wall_s'])}")
    mt = demo["suites"]["eval"]
    assert rows["τ MT-Bench (80), 95% interval"][0] == f"{mt['tau']:.2f} ({mt['interval'][0]:.2f}-{mt['interval'][1]:.2f})"
    # the GPU column agrees with the recipe table's row of the same run (one computation, two tables)
    recipe_row = next(line for line in make_docs.recipe_acceptance(results).splitlines()
                      if f"{make_docs.GPU_HEADLINE}.acceptance.json" in line)
    assert f"| {rows['τ MT-Bench (80), 95% interval'][1]}, 80 |" in recipe_row
    # the test suite's row is the newest line of the CI table
    newest = make_docs.ci_runs(results).splitlines()[-1]
    suite = next(v for k, v in rows.items() if k.startswith("test suite"))[0]
    passed, wall = newest.split(" | ")[3], newest.split(" | ")[5]
    counts = passed.split(" + ")  # the suite, then (in logs that have it) the numerics pass capped to AVX2
    assert suite.startswith(f"{counts[0]} passed" + (f", then the {counts[1]} numerics tests" if counts[1:] else ":"))
    assert wall.split("(")[1].rstrip(")") in suite

    copy = tmp_path / "results"
    shutil.copytree(results, copy)
    newer = {**demo, "date": "2099-01-01", "commit": "0000000", "wall_s": 600,
             "suites": {**demo["suites"], "eval": {**mt, "tau": 1.5, "interval": [1.4, 1.6]}}}
    (copy / "demo-2099-01-01-0000000.run.json").write_text(json.dumps(newer))
    ci = copy / "ci-2099-01-01-0000000.log"
    newest_log = (results / make_docs.newest_ci_log(results).name).read_text()
    count = int(counts[0].replace(",", ""))  # the newest log's suite count, one more in the copy
    ci.write_text(newest_log.replace("[ci] 2026-", "[ci] 2099-").replace(f" {count} passed", f" {count + 1} passed"))
    rows = headline_rows(make_docs.headline(copy))
    assert rows["date, hardware"][0].startswith("2099-01-01") and "0000000" in rows["date, hardware"][0]
    assert rows["τ MT-Bench (80), 95% interval"][0] == "1.50 (1.40-1.60)"
    assert rows["epochs / time"][0].startswith(f"{demo['epochs']} / 10 min 0 s")
    assert next(v for k, v in rows.items() if k.startswith("test suite"))[0].startswith(f"{count + 1} passed")


def test_prompt_sources_recompute_the_records_paired_figures():
    """The prompt-source table is recomputed from the three runs' per-prompt records and must
    agree with the paired differences their own account reports."""
    table = make_docs.prompt_sources(make_docs.BENCH_RESULTS)
    record = (make_docs.BENCH_RESULTS / "demo-synthesized-2026-12-05.md").read_text()
    assert "| 1.378 (1.343-1.416) |" in table and "**1.378 (1.343-1.416)**" in record
    assert "**+0.026 (0.012-0.041)**" in table and "+0.026 (0.012-0.041) \\*" in record
    assert "| +0.013 (−0.007-0.037) |" in table and "+0.013 (−0.007-0.037), not beyond chance" in record


# --------------------------------------------------------------- the README as a user reads it

README_MAX_LINES = 350


def readme_order_problems(text: str) -> list[str]:
    """Why the README is not what a user with a GPU node reads in five minutes: longer than
    README_MAX_LINES, or its own-target path (the GPU-node section, then the SLURM one, each with a
    command block of ten lines or fewer) missing or not ahead of the demo and the tests."""
    problems = []
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    if lines > README_MAX_LINES:
        problems.append(f"{lines} lines, more than {README_MAX_LINES}: move detail into docs/ and link it")
    heads = {m.group(1): m.start() for m in re.finditer(r"^## (.+)$", text, re.M)}
    order = [("GPU node", "## Your own target on a GPU node"), ("SLURM", "## On a SLURM cluster"),
             ("demo and tests", "## The demo and the tests")]
    missing = [h for _, h in order if h[3:] not in heads]
    if missing:
        return problems + [f"no section {h!r}" for h in missing]
    at = [heads[h[3:]] for _, h in order]
    if not at[0] < at[1] < at[2]:
        problems.append("the own-target sections (GPU node, then SLURM) must come before the demo and the tests: "
                        + ", ".join(f"{name} at character {a}" for (name, _), a in zip(order, at)))
    for name, head in order[:2]:
        section = text[heads[head[3:]]:].split("\n## ", 1)[0]
        block = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M)
        if not block:
            problems.append(f"the {name} section has no command block")
        elif len(block.group(1).splitlines()) > 10:
            problems.append(f"the {name} section's command block has {len(block.group(1).splitlines())} lines, "
                            "more than 10")
    return problems


def test_readme_is_short_and_puts_the_own_target_path_first():
    assert readme_order_problems((REPO / "README.md").read_text()) == []


def test_a_readme_with_the_demo_first_or_too_long_is_caught():
    text = (REPO / "README.md").read_text()
    demo = "## The demo and the tests"
    section = demo + text.split(demo, 1)[1].split("\n## ", 1)[0] + "\n"
    demo_first = text.replace(section, "").replace("## Your own target on a GPU node", section + "## Your own "
                                                   "target on a GPU node", 1)
    assert readme_order_problems(demo_first)[0].startswith("the own-target sections (GPU node, then SLURM) must")
    long = text + "padding\n" * (README_MAX_LINES + 1 - text.count("\n"))
    assert readme_order_problems(long) == [f"{README_MAX_LINES + 1} lines, more than {README_MAX_LINES}: "
                                           "move detail into docs/ and link it"]


# ---------------------------------------------------------------- the test suite's own page


def tabled_test_files(text: str) -> set[str]:
    section = text.split("## What each file checks", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(tests/test_\w+\.py)` \|", section, re.M))


def test_testing_page_names_every_test_file():
    files = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    text = (REPO / "docs" / "testing.md").read_text()
    tabled = tabled_test_files(text)
    assert not files - tabled, f"test files missing from docs/testing.md's table: {sorted(files - tabled)}"
    assert not tabled - files, f"docs/testing.md's table names files that do not exist: {sorted(tabled - files)}"
    planted = re.sub(r"^\| `tests/test_docs.py` \|.*\n", "", text, flags=re.M)
    assert files - tabled_test_files(planted) == {"tests/test_docs.py"}


# ----------------------------------------------------------------------- config.yaml's comments


def unnamed_config_keys(text: str, root: dict) -> list[str]:
    """Each section of the schema, and each key of a section config.yaml sets, that config.yaml
    neither sets nor names in a comment of the form `# key (not set: ...)` or `# a, key (...)`
    (a section in a comment at the top level, a section's keys in the comments of that section)."""
    config = yaml.safe_load(text)
    scopes: dict[str, list[str]] = {"": []}
    section = ""
    for line in text.splitlines():
        if m := re.match(r"([a-z_]+):", line):
            section = m.group(1)
        if "#" in line:
            scopes.setdefault(section, []).append(line.split("#", 1)[1].strip())

    def named(key: str, comments: list[str]) -> bool:  # "key (...", "a, key (...", "... (x), key (..."
        return any(re.search(rf"(^|[,.:;] ){key}(, \w+)* \(", c) for c in comments)

    top_level = [line[1:].strip() for line in text.splitlines() if line.startswith("#")]
    missing = []
    for section, node in root["properties"].items():
        if section not in config:  # a section left out entirely takes the defaults: named is enough
            missing += [] if named(section, top_level) else [section]
            continue
        for key in make_docs.resolve(node, root).get("properties") or {}:
            given = isinstance(config[section], dict) and key in config[section]
            if not given and not named(key, scopes.get(section, [])):
                missing.append(f"{section}.{key}")
    return missing


def test_config_yaml_names_every_key_of_its_sections():
    root = yaml.safe_load(make_docs.SCHEMA.read_text())
    text = (REPO / "config.yaml").read_text()
    missing = unnamed_config_keys(text, root)
    assert missing == [], f"config.yaml neither sets nor names (`# key (not set: ...)`) {missing}"
    planted = "\n".join(line for line in text.splitlines()
                        if not (line.lstrip().startswith("# decontaminate_with") or line.startswith("# synthesize")))
    assert unnamed_config_keys(planted, root) == ["prompts.decontaminate_with", "synthesize"]
