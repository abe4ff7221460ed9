# Helpers shared by every rule: paths, per-stage settings and resources, code versions.
# Nothing here writes files: parse-time writes would dirty the DAG on every `snakemake -n`.
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "scripts"))
from pipeline_lib.assets import resolve_asset  # noqa: E402

# Jobs call `python` from PATH: the venv's (make/tests put .venv/bin first), or the conda env
# below under `--sdm conda`.
SCRIPTS = str(Path(workflow.basedir) / "scripts")
CONDA_ENV = "../envs/conda-cuda.yaml" if os.environ.get("PIPELINE_STACK") == "cuda" else "../envs/conda-cpu.yaml"
R = f"results/{config['run_name']}"
TRACE_SHARDS = config["generation"]["num_shards"]
HS_SHARDS = config["hidden_states"]["num_shards"]
VARIANTS = sorted(config["variants"])

# Jobs that only move or summarise files run on the submitting host, even under SLURM.
localrules:
    all,
    traces_gather,
    hidden_states_gather,
    compare_variants,
    plan,


wildcard_constraints:
    shard=r"\d+",
    variant=r"[A-Za-z0-9._-]+",


def settings(section, **extra):
    """The config subset that defines a stage, as JSON for the script's --settings.

    Passed through `params:` so that Snakemake's params trigger reruns exactly the stages
    whose settings changed (and nothing downstream of an unchanged stage)."""
    value = dict(config[section]) if isinstance(config[section], dict) else config[section]
    value.update(extra)
    return json.dumps(value, sort_keys=True)


def prompt_settings(split):
    """What defines one prompt split: its own source, plus the train source when eval rows
    are held out of it (eval.source null, or eval_held_out_samples, which also shrinks the
    train side). Changing only the eval set never reruns the training side."""
    p = config["prompts"]
    held_out = p["eval"]["source"] is None
    add_held = 0 if held_out else p["eval_held_out_samples"]
    value = {"seed": p["seed"], "eval_held_out": held_out}
    if split == "train" or held_out or add_held:
        value["train"] = p["train"]
    if split == "eval":
        value["eval"] = p["eval"]
    if held_out:
        value["eval_fraction"] = p["eval_fraction"]
    if add_held:
        value["eval_held_out_samples"] = add_held
    return json.dumps(value, sort_keys=True)


def acceptance_settings():
    """The measurement's own knobs; thresholds only affect the report."""
    keys = ("backend", "num_speculative_tokens", "num_prompts", "max_tokens", "dtype", "concurrency_one_prompts")
    value = {k: config["verify"][k] for k in keys}
    value["reasoning_parser"] = config["generation"]["reasoning_parser"]
    # Eval prompts are rendered like the training prompts (e.g. Qwen3 enable_thinking).
    value["chat_template_kwargs"] = config["generation"]["chat_template_kwargs"]
    value["trust_remote_code"] = config["target"]["trust_remote_code"]
    return json.dumps(value, sort_keys=True)


def variant_settings(variant):
    merged = dict(config["train"])
    merged.update(config["variants"][variant] or {})
    return json.dumps(merged, sort_keys=True)


def _module_files(base, dotted):
    """The file(s) of module `dotted` under `base`: a module file or a package's __init__."""
    target = base.joinpath(*dotted.split(".")) if dotted else base
    return [f for f in (target.with_suffix(".py"), target / "__init__.py") if f.is_file()]


def _lib_imports(path, seen):
    """pipeline_lib modules (and packages' modules) a file imports, transitively (parsed, not
    imported): `from pipeline_lib.x import y`, `from pipeline_lib import x`, and relative
    imports inside the library at any depth."""
    import ast

    lib = Path(SCRIPTS) / "pipeline_lib"
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # relative: only meaningful inside the library
            if lib not in path.parents:
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            dotted = node.module or ""
        elif node.module and (node.module == "pipeline_lib" or node.module.startswith("pipeline_lib.")):
            base, dotted = lib, node.module.partition(".")[2]
        else:
            continue
        deps = _module_files(base, dotted)
        pkg = base.joinpath(*dotted.split(".")) if dotted else base
        for alias in node.names:  # `from pkg import submodule`
            deps += _module_files(pkg, alias.name)
        for dep in deps:
            if dep not in seen:
                seen.add(dep)
                _lib_imports(dep, seen)
    return seen


def code_version(*scripts):
    """Digest of the shared-library modules a rule's script imports (transitively).

    The script itself is a declared input (see script()); this digest in `params:` makes an
    edit to a library module it uses rerun the rule and everything after it, and an edit to
    a module it does not use rerun nothing."""
    h = hashlib.sha256()
    deps = set()
    for s in scripts:
        _lib_imports(Path(SCRIPTS) / s, deps)
    for p in sorted(deps):
        h.update(p.relative_to(SCRIPTS).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def stage_resources(stage):
    res = dict(config["resources"].get("default") or {})
    res.update(config["resources"].get(stage) or {})
    return res


def res(stage, key):
    return stage_resources(stage)[key]


def target_source_inputs(wildcards):
    """The local file(s) the target is built from, so a changed file reruns the target."""
    t = config["target"]
    if t["source"] in ("local", "gguf") and t["path"]:
        p = Path(resolve_asset(t["path"]))
        return [str(p / "config.json")] if p.is_dir() else [str(p)]
    return []


def prompt_source_inputs(split):
    """The local files a prompt split reads (so an edited file reruns it): its own source, and
    the training source when eval rows are held out of it."""
    p = config["prompts"]
    sources = [p[split]["source"]]
    if split == "eval" and (sources[0] is None or p["eval_held_out_samples"]):
        sources.append(p["train"]["source"])

    def _inputs(wildcards):
        files = []
        for src in filter(None, sources):
            try:
                path = Path(resolve_asset(src))
            except FileNotFoundError:
                continue
            if path.is_file():
                files.append(str(path))
        return files

    return _inputs


def trace_shards(wildcards):
    return expand(f"{R}/traces/shards/{{shard}}-of-{TRACE_SHARDS}.jsonl", shard=range(TRACE_SHARDS))


def trace_shard_summaries(wildcards):
    return expand(f"{R}/traces/shards/{{shard}}-of-{TRACE_SHARDS}.summary.json", shard=range(TRACE_SHARDS))


def hidden_state_shards(wildcards):
    return expand(f"{R}/hidden_states/shards/{{shard}}-of-{HS_SHARDS}.json", shard=range(HS_SHARDS))


def report_outputs(variant):
    return [f"{R}/drafts/{variant}/report/{name}" for name in ("verification.json", "report.md", "report.html")]


def all_outputs():
    outs = []
    for v in VARIANTS:
        outs += report_outputs(v)
        outs.append(f"{R}/drafts/{v}/load_check.json")
    outs.append(f"{R}/drafts/comparison.csv")
    return outs


def provenance_chain(variant):
    """Every provenance.json the draft of `variant` descends from, prompts to draft."""
    return [
        f"{R}/target/provenance.json",
        f"{R}/prompts/train.provenance.json",
        f"{R}/prompts/eval.provenance.json",
        f"{R}/traces/provenance.json",
        f"{R}/tokenized/provenance.json",
        f"{R}/hidden_states/provenance.json",
        f"{R}/drafts/{variant}/provenance.json",
    ]


def invoked_as_dry_run():
    """Snakemake sets workflow.dryrun only after parsing; the plan is printed while parsing."""
    return any(a in ("-n", "--dry-run", "--dryrun") or (a.startswith("-") and not a.startswith("--") and "n" in a[1:] and len(a) <= 4 and a[1:].isalpha())
               for a in sys.argv[1:])


def script(name):
    """A rule's program, declared as an input: editing it reruns the rule (input checksum)."""
    return str(Path(SCRIPTS) / name)
