#!/usr/bin/env python
"""Write the generated documentation: docs/configuration.md from schemas/config.schema.yaml (every
key with its type, default and description, in the schema's order), and the tables between
`<!-- BEGIN GENERATED: name -->` / `<!-- END GENERATED: name -->` markers in docs/*.md
(docs/results.md, docs/testing.md) from the measured files in bench/results/.

    python scripts/make_docs.py           # rewrite the generated pages (make docs)
    python scripts/make_docs.py --check   # exit 1 naming each stale page; writes nothing

tests/test_docs.py runs the check, so the test suite fails when a committed page is stale."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib.io import atomic_write_text, read_text  # noqa: E402
from pipeline_lib.suite_stats import suite_figures  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "config.schema.yaml"
DOCS = REPO / "docs"
CONFIG_PAGE = DOCS / "configuration.md"
BENCH_RESULTS = REPO / "bench" / "results"
COMMAND = "make docs"

# ------------------------------------------------------------------------- configuration page


def resolve(node: Any, root: dict) -> Any:
    """The node with its local `$ref` and `allOf` merged in (the node's own keys win; the
    properties of both are merged key by key)."""
    if not isinstance(node, dict):
        return node
    parts = []
    if "$ref" in node:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"{SCHEMA}: only local $ref is supported, found {ref!r}")
        target: Any = root
        for name in ref[2:].split("/"):
            target = target[name]
        parts.append(resolve(target, root))
    parts += [resolve(sub, root) for sub in node.get("allOf", [])]
    parts.append({k: v for k, v in node.items() if k not in ("$ref", "allOf")})
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            if key == "properties":
                props = merged.setdefault("properties", {})
                for name, sub in value.items():
                    props[name] = {**props.get(name, {}), **sub}
            else:
                merged[key] = value
    return merged


def code(value: Any) -> str:
    return "`" + json.dumps(value) + "`" if not isinstance(value, str) else f"`{value}`"


def type_text(node: dict) -> str:
    """Type, allowed values and bounds in a few words."""
    if "enum" in node:
        return "one of " + ", ".join(code(v) for v in node["enum"])
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if "if" in node and "then" in node and "else" in node:
        types = [t for branch in ("then", "else") for t in [node[branch].get("type")] if t] or ["object", "array"]
    text = " or ".join(types) if types else "any"
    bounds = [(f">= {node['minimum']}" if "minimum" in node else None),
              (f"> {node['exclusiveMinimum']}" if "exclusiveMinimum" in node else None),
              (f"<= {node['maximum']}" if "maximum" in node else None),
              (f"< {node['exclusiveMaximum']}" if "exclusiveMaximum" in node else None),
              (f"matching `{node['pattern']}`" if "pattern" in node else None),
              (f"at least {node['minItems']} item(s)" if "minItems" in node else None)]
    bounds = [b for b in bounds if b]
    return text + (", " + ", ".join(bounds) if bounds else "")


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def key_rows(node: dict, root: dict, path: str, seen: set[str]) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, description) for the node and everything nested in it, depth
    first in the schema's order. A row equal to one already given under another form of the
    same key (a source given alone or in a list) is not repeated."""
    node = resolve(node, root)
    if "if" in node and "then" in node and "else" in node:
        node = {**node, "then": resolve(node["then"], root), "else": resolve(node["else"], root)}
    default = code(node["default"]) if "default" in node else ""
    row = (f"`{path}`", cell(type_text(node)), default, cell(node.get("description", "")))
    signature = (path.replace("[]", ""),) + row[1:]
    if signature not in seen:
        seen.add(signature)
        yield row
    branches = [node] + [node[b] for b in ("then", "else") if isinstance(node.get(b), dict)]
    for branch in branches:
        for name, sub in (branch.get("properties") or {}).items():
            yield from key_rows(sub, root, f"{path}.{name}", seen)
        items = branch.get("items")
        if isinstance(items, dict) and resolve(items, root).get("properties"):
            for name, sub in resolve(items, root)["properties"].items():
                yield from key_rows(sub, root, f"{path}[].{name}", seen)
        extra = branch.get("additionalProperties")
        if isinstance(extra, dict):
            for name, sub in (resolve(extra, root).get("properties") or {}).items():
                yield from key_rows(sub, root, f"{path}.<name>.{name}", seen)


def configuration_page(schema_path: Path = SCHEMA) -> str:
    root = yaml.safe_load(read_text(schema_path, "config schema"))
    lines = ["# Configuration reference", "",
             f"<!-- Generated from {schema_path.relative_to(REPO)} by scripts/make_docs.py: edit the schema, "
             f"then run `{COMMAND}`. -->", "",
             cell(root.get("description", "")), "",
             "`config.yaml` is the demo's config, every key commented. A file passed with `--configfile` "
             "replaces it entirely; keys it leaves out take the defaults below. Keys are listed in the "
             "schema's order; `a.b` is key `b` inside section `a`, `a[].b` a key of each item of list "
             "`a`, `a.<name>.b` a key under a name you choose.", ""]
    sections = [(name, node) for name, node in root["properties"].items()]
    lines += ["Sections: " + ", ".join(f"[`{n}`](#{n})" for n, _ in sections) + ".", ""]
    for name, node in sections:
        rows = list(key_rows(node, root, name, set()))
        lines += [f"## {name}", ""]
        if resolve(node, root).get("properties"):  # a section: its description leads, its keys follow
            lines += [rows[0][3], ""] if rows[0][3] else []
            rows = rows[1:]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    required = root.get("required") or []
    if required:
        lines += ["Required at the top level: " + ", ".join(f"`{k}`" for k in required) + ".", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- results tables

# What each committed run was: date, hardware, software, configuration. Figures come from the files.
H200 = "one NVIDIA H200 141 GB, torch 2.11.0+cu130, transformers 5.17"
RECIPE_RUNS = {
    "gpu-recipe-2026-12-04": "2026-12-04, first turn only, 2 epochs (an overlay since removed); "
                             "held-out prompts pooled into MT-Bench's 112",
    "gpu-recipe-2026-12-04b": "2026-12-04, two turns, 4 epochs, 7,855 conversations (before the self-instruct seeds)",
    "gpu-recipe-2026-12-04c": "2026-12-04, two turns, 4 epochs, 8,347 conversations",
    "gpu-recipe-2026-12-04c.epochs-8": "the same, variant `epochs-8` (trained on its hidden states)",
    "gpu-recipe-2026-12-04c.lr-3e-4": "the same, variant `lr-3e-4`",
    "gpu-recipe-2026-12-04d": "2026-12-04, `configs/gpu-recipe.yaml` as committed (8 epochs), traces by `generate`",
    "gpu-recipe-2026-12-04e": "2026-12-04, `configs/gpu-recipe.yaml` as committed (8 epochs), traces by the CUDA-graph loop",
    "gpu-vllm-2026-12-05": "2026-12-05, `configs/gpu-recipe-vllm.yaml`: every stage in vLLM 0.26 (traces, hidden "
                           "states, EAGLE-3 acceptance measured by vLLM itself)",
}
TRAIN_METRICS = {
    "gpu-recipe-2026-12-04b.train_metrics.csv": "gpu-recipe-2026-12-04b",
    "gpu-recipe-2026-12-04c.default.train_metrics.csv": "gpu-recipe-2026-12-04c",
    "gpu-recipe-2026-12-04c.epochs-8.train_metrics.csv": "gpu-recipe-2026-12-04c.epochs-8",
    "gpu-recipe-2026-12-04c.lr-3e-4.train_metrics.csv": "gpu-recipe-2026-12-04c.lr-3e-4",
    "gpu-recipe-2026-12-04d.train_metrics.csv": "gpu-recipe-2026-12-04d",
    "gpu-recipe-2026-12-04e.train_metrics.csv": "gpu-recipe-2026-12-04e",
    "gpu-vllm-2026-12-05.train_metrics.csv": "gpu-vllm-2026-12-05",
}
SUITES = [("eval", "MT-Bench (eval)"), ("held-out", "held-out"), ("humaneval", "HumanEval"), ("champ", "CHAMP")]


def link(name: str) -> str:
    return f"[`{name}`](../bench/results/{name})"


def table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def described(results: Path, pattern: str, known: dict) -> None:
    """Every measured file of the kind has its run described here: a new run is not left out."""
    for path in sorted(results.glob(pattern)):
        stem = path.name.removesuffix(".acceptance.json")
        if path.name not in known and stem not in known:
            raise ValueError(f"{path}: no description of this run in scripts/make_docs.py (RECIPE_RUNS / "
                             f"TRAIN_METRICS): add its date, configuration and file, then run `{COMMAND}`")


def recipe_acceptance(results: Path) -> str:
    for pattern in ("gpu-recipe-*.acceptance.json", "gpu-vllm-*.acceptance.json"):
        described(results, pattern, RECIPE_RUNS)
    rows = []
    for stem, what in RECIPE_RUNS.items():
        name = f"{stem}.acceptance.json"
        run = json.loads(read_text(results / name))
        figures = suite_figures(run["requests"]["trained"])
        taus = []
        for suite, _ in SUITES:
            f = figures.get(suite)
            taus.append("—" if f is None else
                        f"{f['mean_acceptance_length']:.2f} ({f['interval'][0]:.2f}-{f['interval'][1]:.2f}), {f['prompts']}")
        rates = run["acceptance"]["trained"]["acceptance_rate_per_position"]
        rows.append([link(name), what, *taus, " / ".join(f"{r:.2f}" for r in rates)])
    return table(["file", "run", *(f"τ {label}, 95% interval, prompts" for _, label in SUITES),
                  "acceptance rate per position (pooled)"], rows)


def recipe_training(results: Path) -> str:
    for pattern in ("gpu-recipe-*train_metrics.csv", "gpu-vllm-*train_metrics.csv"):
        described(results, pattern, TRAIN_METRICS)
    rows = []
    for name, stem in TRAIN_METRICS.items():
        metrics = pd.read_csv(results / name)
        val, train = metrics[metrics["split"] == "val"], metrics[metrics["split"] == "train"]
        last = val.iloc[-1]
        rows.append([link(name), RECIPE_RUNS[stem], str(int(last["epoch"]) + 1),
                     " / ".join(f"{last[f'full_acc_{i}']:.3f}" for i in range(3)), f"{last['loss']:.2f}",
                     f"{train['tokens_per_s'].iloc[-1]:,.0f}"])
    return table(["file", "run", "epochs", "validation full accuracy, positions 0 / 1 / 2 (last epoch)",
                  "validation loss", "training tokens/s, last epoch"], rows)


def traces_speed(results: Path) -> str:
    rows = []
    for path in sorted(results.glob("traces-speed-*.json")):
        data = json.loads(read_text(path))
        for run in ([data] if "backend" in data else list(data.values())):
            rows.append([link(path.name), str(run["batch_size"]), run["backend"]["decoding"],
                         f"{run['backend']['tok_s']:,}", f"{run['generate_alone']['tok_s']:,}",
                         f"{run['ratio']:.2f}", f"{run['backend']['tokens']:,}"])
    return table(["file", "batch", "backend decoding", "backend tok/s", "`generate` alone tok/s", "ratio",
                  "tokens"], rows)


CI_PASSED = re.compile(r"=+ (\d+) passed.* in ([\d.]+)s")
CI_WALL = re.compile(r"^rc=(\d+) wall=(\d+) s", re.M)
CI_START = re.compile(r"^\[ci\] (\S+) make test", re.M)


def ci_runs(results: Path) -> str:
    rows = []
    for path in sorted(results.glob("ci-*.log"), key=lambda p: CI_START.search(read_text(p)).group(1)):
        text = read_text(path)
        # Since the portable run, `make test` runs pytest twice (the suite, then the numerics tests
        # capped to AVX2): the figures add up over both.
        runs, wall = CI_PASSED.findall(text), CI_WALL.search(text)
        passed, seconds = " + ".join(n for n, _ in runs), sum(float(s) for _, s in runs)
        commit = path.stem.rsplit("-", 1)[-1]
        rows.append([link(path.name), commit, CI_START.search(text).group(1), passed,
                     f"{seconds:,.0f}", f"{int(wall.group(2)):,} ({int(wall.group(2)) // 60} min "
                     f"{int(wall.group(2)) % 60} s)", wall.group(1)])
    return table(["log", "commit", "started (UTC)", "tests passed", "pytest s", "`.ci/run` wall s", "rc"], rows)


GENERATED: dict[str, Callable[[Path], str]] = {
    "gpu-recipe-acceptance": recipe_acceptance,
    "gpu-recipe-training": recipe_training,
    "traces-speed": traces_speed,
    "ci-runs": ci_runs,
}
BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)",
                   re.S)


def fill_blocks(page: str, where: Path, results: Path = BENCH_RESULTS) -> str:
    """The page with every generated block filled from `results`; a block of unknown name is an error."""
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATED:
            raise ValueError(f"{where}: unknown generated block {name!r} (known: {', '.join(GENERATED)})")
        return m.group(1) + GENERATED[name](results) + "\n" + m.group(4)
    return BLOCK.sub(fill, page)


# ----------------------------------------------------------------------------------- main


def expected_pages() -> dict[Path, str]:
    """Every generated page as it should be: the configuration page, and each docs page that
    holds generated blocks."""
    pages = {CONFIG_PAGE: configuration_page()}
    for path in sorted(DOCS.glob("*.md")):
        text = read_text(path, "docs page")
        if path != CONFIG_PAGE and BLOCK.search(text):
            pages[path] = fill_blocks(text, path)
    return pages


def stale_pages() -> list[Path]:
    return [path for path, text in expected_pages().items()
            if not path.exists() or path.read_text(encoding="utf-8") != text]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when a generated page differs; write nothing")
    args = p.parse_args()
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"{path.relative_to(REPO)} is stale: run `{COMMAND}` and commit it", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for path, text in expected_pages().items():
        atomic_write_text(path, text)
        print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
