# Helpers shared by every rule: paths, per-stage settings and resources, code versions.
# Nothing here writes files: parse-time writes would dirty the DAG on every `snakemake -n`.
import hashlib
import json
import os
import shlex
import sys
from functools import lru_cache
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError

sys.path.insert(0, str(Path(workflow.basedir) / "scripts"))
from pipeline_lib import code_digest, stages  # noqa: E402
from pipeline_lib.acceptance.job import BASELINE_KEYS  # noqa: E402
from pipeline_lib.assets import PREFIX as PYPI_PREFIX, resolve_asset  # noqa: E402
from pipeline_lib.digests import path_digest  # noqa: E402
from pipeline_lib.resources import stage_resources  # noqa: E402

# Jobs call `python` from PATH: the venv's (make/tests put .venv/bin first), or the conda env
# below under `--sdm conda`.
SCRIPTS = Path(workflow.basedir) / "scripts"
CONDA_ENV = "../envs/conda-cuda.yaml" if os.environ.get("PIPELINE_STACK") == "cuda" else "../envs/conda-cpu.yaml"
R = f"results/{config['run_name']}"
VARIANTS = sorted(config["variants"])

# Compute dtypes: every `auto` (generation, hidden_states, train, verify) is resolved here, once,
# in place, by the stage's GPUs and this CPU's bf16 instructions, so every rule and every reader
# of `config` sees the dtype the stage computes in; the jobs inherit the decision (for their
# provenance) and SLURM jobs the CPU verdict (pipeline_lib/dtypes.py). The plan prints it.
from pipeline_lib import dtypes  # noqa: E402

DTYPE_RESOLUTION = dtypes.resolve_in_place(config)

# Stage instances (pipeline_lib/stages.py): per variant, the traces / tokenized / hidden_states
# directories it is built from, and per directory what defines it. Rules reach them only
# through the input functions below, by the wildcard that names the directory.
with open(Path(workflow.basedir) / "schemas/config.schema.yaml") as _schema:
    # libyaml's loader where PyYAML has it: the schema is parsed by every Snakemake run.
    stages.check_variants(config, yaml.load(_schema, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
stages.check_verify(config)
LINEAGE, STAGE_INSTANCES = stages.plan_instances(config)

# Jobs that only move or summarise files run on the submitting host, even under SLURM.
localrules:
    all,
    traces_gather,
    hidden_states_gather,
    compare_variants,
    plan,


wildcard_constraints:
    shard=r"\d+",
    num_shards=r"\d+",
    variant=r"[A-Za-z0-9._-]+",
    baseline=rf"[0-9a-f]{{{stages.DIGEST_CHARS}}}",
    # A stage instance's directory: the base config's plain name, or <stage>-<digest>.
    traces=stages.instance_pattern("traces"),
    tokenized=stages.instance_pattern("tokenized"),
    hidden_states=stages.instance_pattern("hidden_states"),


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
    train side). Training rows are decontaminated against the whole eval source, so the train
    side depends on which eval source it is, but not on how many eval prompts are measured."""
    p = config["prompts"]
    held_out = p["eval"]["source"] is None
    add_held = 0 if held_out else p["eval_held_out_samples"]
    value = {"seed": p["seed"], "eval_held_out": held_out}
    if split == "train" or held_out or add_held:
        value["train"] = p["train"]
        if p["mix_num_samples"] is not None:
            value["mix_num_samples"] = p["mix_num_samples"]
    if split == "eval":
        value["eval"] = p["eval"]
    elif decontaminated():
        value["eval"] = {k: v for k, v in p["eval"].items() if k != "num_samples"}
    if decontaminated() and (split == "train" or add_held):
        value["decontamination_ngram"] = p["decontamination_ngram"]
        # Only when set: existing training prompts stay up to date.
        if p["decontaminate_with"]:
            value["decontaminate_with"] = p["decontaminate_with"]
    if held_out:
        value["eval_fraction"] = p["eval_fraction"]
    if add_held:
        value["eval_held_out_samples"] = add_held
    return json.dumps(value, sort_keys=True)


def decontaminated():
    """Training prompts are checked against an eval source (not when eval rows are held out
    of the training source itself)."""
    p = config["prompts"]
    return p["eval"]["source"] is not None and p["decontamination_ngram"] > 0


def suite_entries():
    """verify.suites by name (the schema checks names; here that they are unique and not 'eval')."""
    entries = {}
    for i, s in enumerate(config["verify"]["suites"]):
        if s["name"] in entries or s["name"] in ("eval", "held-out"):
            raise ValueError(f"verify.suites[{i}].name = {s['name']!r}: used twice or reserved ('eval' is "
                             f"prompts/eval.jsonl, 'held-out' its held-out training prompts); give each "
                             f"suite its own name")
        entries[s["name"]] = {**s, "index": i}
    return entries


def suite_settings(name):
    """What defines one suite's prompts and overlap record: its own entry, the seed and the
    n-gram test; whether it was declared at training time (prompts.eval / decontaminate_with)."""
    p = config["prompts"]
    s = suite_entries()[name]
    declared = {p["eval"]["source"]} | {e["source"] for e in p["decontaminate_with"]} if decontaminated() else set()
    value = {**s, "seed": p["seed"], "ngram": p["decontamination_ngram"] or 8,
             "declared_at_training": s["source"] in declared}
    return json.dumps(value, sort_keys=True)


def suite_prompt_files():
    return {name: f"{R}/eval_suites/{name}/prompts.jsonl" for name in suite_entries()}


def suite_flags():
    """One --suite name=path per verify.suites entry (ids are prefixed with the name)."""
    return " ".join(f"--suite {n}={p}" for n, p in suite_prompt_files().items())


def suite_overlap_files():
    return [f"{R}/eval_suites/{name}/overlap.json" for name in suite_entries()]


def acceptance_settings(variant):
    """The measurement's own knobs; thresholds only affect the report."""
    cfg = stages.variant_config(config, variant)
    keys = ("backend", "num_speculative_tokens", "num_prompts", "max_tokens", "dtype", "concurrency_one_prompts")
    value = {k: cfg["verify"][k] for k in keys}
    # Only when set: the default (all prompts) leaves existing acceptance results up to date.
    if cfg["verify"]["untrained_prompts"] is not None:
        value["untrained_prompts"] = cfg["verify"]["untrained_prompts"]
    if cfg["verify"]["backend"] == "transformers":  # vLLM batches on its own
        value["batch_size"] = cfg["verify"]["batch_size"]
    value["reasoning_parser"] = cfg["generation"]["reasoning_parser"]
    # Eval prompts are rendered like the training prompts (e.g. Qwen3 enable_thinking).
    value["chat_template_kwargs"] = cfg["generation"]["chat_template_kwargs"]
    value["trust_remote_code"] = cfg["target"]["trust_remote_code"]
    value["suites"] = sorted(suite_entries())  # a removed suite reruns the measurement
    value["degenerate"] = cfg["verify"]["degenerate"]
    return json.dumps(value, sort_keys=True)


def baseline_settings(variant):
    """What the run without speculation depends on (pipeline_lib.acceptance.BASELINE_KEYS): the
    variant's acceptance settings less those only the drafts' runs read."""
    value = json.loads(acceptance_settings(variant))
    return json.dumps({k: value[k] for k in BASELINE_KEYS if k in value}, sort_keys=True)


def baseline_key(variant):
    """The baseline file's name: a digest of its settings, so variants with equal settings share one."""
    return hashlib.sha256(baseline_settings(variant).encode()).hexdigest()[: stages.DIGEST_CHARS]


def baseline_file(variant):
    return f"{R}/verify/baseline/{baseline_key(variant)}.json"


def baseline_settings_for_key(key):
    """The settings behind a baseline key (the acceptance_baseline job's params)."""
    for variant in VARIANTS:
        if baseline_key(variant) == key:
            return baseline_settings(variant)
    raise WorkflowError(f"{R}/verify/baseline/{key}.json: no variant of this config has these baseline settings")


def contract_settings(variant):
    """What the contract checks read: the draft type and the k it is served with, the reference draft, the train-vs-serve sample size, and
    how the variant's tokenized rows were rendered (the same template arguments for vLLM's render)."""
    cfg = stages.variant_config(config, variant)
    kind = cfg["train"]["draft_type"]
    # The type and, for a parallel type, the k its draft must have been trained to propose; an
    # EAGLE-3 variant passes neither, so its contract does not rerun when k changes (and runs
    # made before draft types existed keep theirs).
    typed = {} if kind == "eagle3" else {"draft_type": kind,
                                         "num_speculative_tokens": cfg["verify"]["num_speculative_tokens"]}
    return json.dumps({**typed,
                       "reference_draft": cfg["verify"]["reference_draft"],
                       "serve_render_rows": cfg["verify"]["serve_render_rows"],
                       "chat_template_kwargs": cfg["generation"]["chat_template_kwargs"],
                       "trust_remote_code": cfg["target"]["trust_remote_code"]}, sort_keys=True)


def variant_train(variant):
    """The train section as the variant sees it (base keys with its overrides)."""
    return stages.variant_config(config, variant)["train"]


def variant_settings(variant):
    return stages.settings_json(variant_train(variant))


# --------------------------------------------------------------------------- stage instances
# A rule of an upstream stage has a wildcard named after the stage (traces, tokenized,
# hidden_states) whose value is the instance's directory; these input functions look up what
# that instance reads and what defines it. Downstream rules find a variant's instances by its
# `variant` wildcard. No rule tests which variant or instance it serves.


def stage_instance(stage, wildcards):
    name = getattr(wildcards, stage)
    if name not in STAGE_INSTANCES:
        raise WorkflowError(f"{R}/{name}: no variant of this config is built from this {stage} instance "
                            f"(the instances in use: {', '.join(sorted(STAGE_INSTANCES))})")
    return STAGE_INSTANCES[name]


def instance_settings(stage):
    """params: the settings that define the instance the `stage` wildcard names."""
    return lambda wc: stages.settings_json(stage_instance(stage, wc).settings)


def upstream_file(stage, name):
    """input: file `name` of the instance that the `stage` wildcard's instance reads."""
    return lambda wc: f"{R}/{stage_instance(stage, wc).reads}/{name}"


def shard_files(stage, suffix):
    """input: every shard file of the `stage` wildcard's instance (its own num_shards)."""

    def _files(wc):
        n = stage_instance(stage, wc).settings["num_shards"]
        return [f"{R}/{getattr(wc, stage)}/shards/{i}-of-{n}{suffix}" for i in range(n)]

    return _files


def variant_file(stage, name):
    """input: file `name` of the `stage` instance that the `variant` wildcard's draft is built from."""
    return lambda wc: f"{R}/{LINEAGE[wc.variant][stage].dir}/{name}"


def variant_lineage(variant):
    """What the report and the comparison table say a draft descends from: each upstream
    stage's directory, and the settings in which the variant differs from the base config."""
    return stages.settings_json({
        "stage_instances": {stage: inst.dir for stage, inst in LINEAGE[variant].items()},
        "changed_settings": stages.changed_settings(config, variant),
    })


# --------------------------------------------------------------------------- code and sources


@lru_cache(maxsize=None)
def code_version(*scripts):
    """Content digest of a rule's program(s) and of the library modules they import
    (transitively), for `params:` (pipeline_lib/code_digest.py).

    Editing a program, or a library module it uses, reruns the rule and everything after it;
    editing a module it does not use reruns nothing. Files are named relative to scripts/, so
    where the checkout lives (another path, a second clone) never reruns anything."""
    return code_digest.code_version(SCRIPTS, *scripts)


def script(name):
    """A rule's program, for `params:` (its content is in code_version()). A pathlib.Path is
    not a builtin value, so Snakemake keeps it out of the params it records and compares: the
    checkout's location is never a reason to rerun. As an input it would be (the set of input
    paths changes when the checkout moves)."""
    return SCRIPTS / name


def res(stage, key):
    """A stage's resource (pipeline_lib/resources.py: its own over resources.default's)."""
    return stage_resources(config, stage)[key]


def pipeline_parallel(stage):
    """resources.<stage>.pipeline_parallel (1 unless asked): run_on_gpus.py hands it to the job,
    whose engine takes tensor parallel from the rest of its GPUs (pipeline_lib/parallel.py)."""
    return int(stage_resources(config, stage).get("pipeline_parallel") or 1)


def is_packaged(ref):
    return isinstance(ref, str) and ref.startswith(PYPI_PREFIX)


def local_files(refs):
    """The local (not pypi:) files among `refs` that exist, as inputs: an edited file reruns."""
    return [ref for ref in refs if ref and not is_packaged(ref) and Path(ref).is_file()]


@lru_cache(maxsize=None)
def packaged_digest(ref):
    """Content digest of a pypi: asset, for `params:`. Its resolved path lies inside the venv,
    so as an input a venv at another path would rerun everything; its bytes decide instead.
    None when the package is missing (the rule's script then says which and what to do)."""
    try:
        return path_digest(resolve_asset(ref))
    except FileNotFoundError:
        return None


def packaged_digests(refs):
    return {ref: packaged_digest(ref) for ref in refs if is_packaged(ref)}


def target_source_refs():
    t = config["target"]
    return [t["path"]] if t["source"] in ("local", "gguf") and t["path"] else []


def target_source_inputs(wildcards):
    """The local file(s) the target is built from (a model dir by its config.json)."""
    files = []
    for ref in target_source_refs():
        if not is_packaged(ref):
            p = Path(ref)
            files.append(str(p / "config.json") if p.is_dir() else str(p))
    return files


def prompt_source_refs(split):
    """The sources a prompt split reads: its own, and the training source when eval rows are
    held out of it."""
    p = config["prompts"]

    def source_names(section):  # one source, or a list of them (a training mix)
        return [e["source"] for e in section] if isinstance(section, list) else [section["source"]]

    sources = source_names(p[split])
    if split == "eval" and (sources[0] is None or p["eval_held_out_samples"]):
        sources += source_names(p["train"])
    if split == "train" and decontaminated():
        sources += source_names(p["eval"]) + [e["source"] for e in p["decontaminate_with"]]
    return [s for s in sources if s]


def prompt_source_inputs(split):
    return lambda wc: local_files(prompt_source_refs(split))


def report_outputs(variant):
    return [f"{R}/drafts/{variant}/report/{name}" for name in ("verification.json", "report.md", "report.html")]


def all_outputs():
    outs = []
    for v in VARIANTS:
        outs += report_outputs(v)
        outs.append(f"{R}/drafts/{v}/load_check.json")
    outs.append(f"{R}/drafts/comparison.csv")
    if config["forecast"]["enabled"]:
        outs.append(f"{R}/forecast/forecast.json")
    return outs


def provenance_chain(variant):
    """Every provenance.json the draft of `variant` descends from, prompts to draft (online
    training has no hidden-states artifact: its train job records the server instead)."""
    return [
        f"{R}/target/provenance.json",
        f"{R}/prompts/train.provenance.json",
        f"{R}/prompts/eval.provenance.json",
        *(f"{R}/{inst.dir}/provenance.json" for inst in LINEAGE[variant].values()),
        f"{R}/drafts/{variant}/provenance.json",
    ]


def invoked_as_dry_run():
    """Snakemake sets workflow.dryrun only after parsing; the plan is printed while parsing."""
    return any(a in ("-n", "--dry-run", "--dryrun") or (a.startswith("-") and not a.startswith("--") and "n" in a[1:] and len(a) <= 4 and a[1:].isalpha())
               for a in sys.argv[1:])


# --------------------------------------------------------------------------- hidden states for training
# hidden_states.mode (a variant may set it): offline trains on the files of the variant's
# hidden_states instance; online on its tokenized data, with a vLLM server train_draft starts
# and stops itself (no hidden-states instance: stages.trains_online).


def hs_online(variant):
    return stages.trains_online(stages.variant_config(config, variant))


def hs_manifest_for(variant):
    """What the draft's hidden states are checked against: the extraction's manifest, or (online)
    the train job's record of the server it started."""
    if hs_online(variant):
        return f"{R}/drafts/{variant}/hidden_states.json"
    return f"{R}/{LINEAGE[variant]['hidden_states'].dir}/manifest.json"


def train_inputs(wildcards):
    """input: the target, the tokenized stats (their row ids group rows into conversations:
    train.max_conversations), and the hidden states (offline) or the tokenized data (online)."""
    inputs = {"target": f"{R}/target/model", "target_manifest": f"{R}/target/manifest.json",
              "tokenized_stats": variant_file("tokenized", "stats.json")(wildcards)}
    if hs_online(wildcards.variant):
        return inputs | {"data": variant_file("tokenized", "data")(wildcards),
                         "token_freq": variant_file("tokenized", "token_freq.pt")(wildcards)}
    return inputs | {"data": variant_file("hidden_states", "data")(wildcards),
                     "hs_manifest": variant_file("hidden_states", "manifest.json")(wildcards)}


# What online training reads from the hidden_states section (offline: only the mode; the rest
# is in the manifest of the files it trains on).
ONLINE_HS_KEYS = ("mode", "storage", "aux_layer_ids", "dtype", "server_gpus", "server_start_timeout_s",
                  "request_timeout_s")


def train_hs_settings(variant):
    cfg = stages.variant_config(config, variant)
    if not stages.trains_online(cfg):
        return stages.settings_json({"mode": "offline"})
    value = {k: cfg["hidden_states"][k] for k in ONLINE_HS_KEYS}
    value["trust_remote_code"] = cfg["target"]["trust_remote_code"]
    return stages.settings_json(value)


def train_source_args(wildcards, input):
    """The inputs that differ by mode, as train_draft.py flags."""
    if "hs_manifest" in input.keys():
        return f"--hs-manifest {shlex.quote(input.hs_manifest)}"
    return f"--token-freq {shlex.quote(input.token_freq)}"


# --------------------------------------------------------------------------- synthesized prompts
# rules/synthesize.smk: the requests the target writes itself, a training source where a
# prompts.train entry says `source: synthesized`.

SYNTHESIZED = f"{R}/synthesized/synthesized.jsonl"
# What a shard's candidates depend on (with the target's chat_template_kwargs and trust_remote_code).
SYNTHESIS_KEYS = ("num_prompts", "backend", "max_tokens", "temperature", "top_p", "seed", "batch_size",
                  "request_timeout_s", "retries", "system_prompt", "topics")


def synthesis_settings():
    s = config["synthesize"]
    value = {k: s[k] for k in SYNTHESIS_KEYS}
    value["chat_template_kwargs"] = config["generation"]["chat_template_kwargs"]
    value["trust_remote_code"] = config["target"]["trust_remote_code"]
    return json.dumps(value, sort_keys=True)


def synthesis_suites():
    """Every eval suite the synthesized requests are decontaminated against, read whole."""
    p = config["prompts"]
    keys = ("source", "format", "split", "revision")
    entries = [{"setting": "prompts.eval", **{k: p["eval"].get(k) for k in keys}}] if p["eval"]["source"] else []
    entries += [{"setting": f"prompts.decontaminate_with[{i}]", **{k: e.get(k) for k in keys}}
                for i, e in enumerate(p["decontaminate_with"])]
    entries += [{"setting": f"verify.suites[{i}] ({s['name']})", **{k: s.get(k) for k in keys}}
                for i, s in enumerate(config["verify"]["suites"])]
    return entries


def synthesis_gather_settings():
    return json.dumps({"filters": config["synthesize"]["filters"], "suites": synthesis_suites()}, sort_keys=True)


def synthesis_shards(suffix):
    n = config["synthesize"]["num_shards"]
    return [f"{R}/synthesized/shards/{i}-of-{n}{suffix}" for i in range(n)]


def uses_synthesized():
    train = config["prompts"]["train"]
    return any(e.get("source") == "synthesized" for e in (train if isinstance(train, list) else [train]))


def with_synthesized(settings_json):
    """A prompt split's settings, with where the synthesized prompts are when a training source
    names them (unchanged otherwise, so existing prompt sets stay up to date)."""
    value = json.loads(settings_json)
    if not uses_synthesized() or "train" not in value:
        return settings_json
    return json.dumps({**value, "synthesized_path": SYNTHESIZED}, sort_keys=True)


def synthesized_input(split):
    """input of prompts_<split>: the synthesized prompts, when a training source names them and
    the split reads the training sources."""

    def _input(wildcards):
        p = config["prompts"]
        if not uses_synthesized():
            return []
        if split == "eval" and not (p["eval"]["source"] is None or p["eval_held_out_samples"]):
            return []
        return [SYNTHESIZED]

    return _input


# --------------------------------------------------------------------------- speedup forecast
def forecast_settings():
    """What defines the forecast: its own section and the draft it stands for (the base
    config's train type, layers and draft vocabulary, verify's k, the aux layers). Training
    settings that do not change the draft's shape (epochs, lr, data) do not rerun it."""
    train, verify = config["train"], config["verify"]
    value = {**config["forecast"], "draft_type": train["draft_type"], "draft_layers": train["draft_layers"],
             "draft_vocab_size": train["draft_vocab_size"], "num_speculative_tokens": verify["num_speculative_tokens"],
             "aux_layer_ids": config["hidden_states"]["aux_layer_ids"]}
    value.pop("enabled")
    if value.get("speculative_token_counts") is None:  # the default (verify's k): same settings, no rerun
        value.pop("speculative_token_counts", None)
    return json.dumps(value, sort_keys=True)
