"""Stage instances: which traces, tokenized data and hidden states each draft variant is built
from.

A variant (`variants: {name: {...}}` in the config) overrides keys of the base config's
`generation`, `tokenize`, `hidden_states` and `train` sections, written `{section: {key: value}}`;
train keys may also be given directly (`{lr: 0.01}`, the form from before variants reached
upstream stages). Each section is merged one level deep: a dict-valued key such as
`chat_template_kwargs` is replaced whole.

An upstream artifact is defined by the settings its rule receives (its section, plus the few
keys it takes from other sections: STAGES below) and by the artifact it reads. Variants whose
chains of settings are equal share one artifact, so a train-only variant reuses every upstream
artifact, a tokenize-only variant shares the traces, and so on.

Directory names: the base config's instance keeps the plain name (results/<run>/traces,
tokenized, hidden_states), so runs made before variants existed stay valid; any other instance
is `<stage>-<digest>`, the first DIGEST_CHARS hex digits of the sha256 of its chain's settings.
The name depends on nothing but those settings: adding, removing or renaming another variant
never renames (and so never reruns) an artifact. A new key in a section needs nothing here: it
is part of the merged section, hence of the settings, hence of the name (unless the stage lists
it in `not_defining`: a key of its section only a later stage reads).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from . import draft_types, dtypes
from .errors import PipelineError

VARIANT_SECTIONS = ("generation", "tokenize", "hidden_states", "train")
# Shared by every variant: one target, one prompt set, one measurement, one plan.
SHARED_SECTIONS = ("run_name", "target", "prompts", "verify", "plan", "resources", "variants")
DIGEST_CHARS = 10


def _target_code(cfg: dict) -> dict:
    return {"trust_remote_code": cfg["target"]["trust_remote_code"]}


@dataclass(frozen=True)
class Stage:
    name: str  # the base config's directory under results/<run>/, and the wildcard's name
    section: str  # the config section that defines it
    reads: str | None  # the stage whose artifact it reads (None: only the target and prompts)
    borrowed: Callable[[dict], dict]  # keys it takes from other sections
    # Keys of its section that only a later stage reads: they define nothing in this artifact.
    not_defining: tuple[str, ...] = ()
    # Whether a merged config builds this stage at all.
    built: Callable[[dict], bool] = lambda cfg: True


# hidden_states keys only the training job reads (hidden_states.mode: online starts its own
# server): switching mode, or tuning the server, reruns no extraction and renames no instance.
TRAINING_ONLY_HS_KEYS = ("mode", "server_gpus", "server_start_timeout_s", "request_timeout_s")


def trains_online(cfg: dict) -> bool:
    """Online training (hidden_states.mode: online): no hidden-states artifact; train_draft
    asks its own vLLM server."""
    return cfg["hidden_states"].get("mode", "offline") == "online"


# In DAG order. Tokenize renders the loss mask with the template arguments generation used
# (e.g. enable_thinking), so those are part of what defines tokenized data.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("traces", "generation", None, _target_code),
    Stage("tokenized", "tokenize", "traces",
          lambda c: {**_target_code(c), "chat_template_kwargs": c["generation"]["chat_template_kwargs"]}),
    Stage("hidden_states", "hidden_states", "tokenized", _target_code,
          not_defining=TRAINING_ONLY_HS_KEYS, built=lambda c: not trains_online(c)),
)}


@dataclass(frozen=True)
class StageInstance:
    stage: str  # a key of STAGES
    dir: str  # directory under results/<run>/
    settings: dict[str, Any]  # what its rule passes as --settings
    reads: str | None  # directory of the instance it reads


def instance_pattern(stage: str) -> str:
    """Regex of the directory names of `stage`'s instances (a Snakemake wildcard constraint)."""
    return rf"{STAGES[stage].name}(?:-[0-9a-f]{{{DIGEST_CHARS}}})?"


def settings_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def variant_overrides(name: str, spec: dict | None) -> dict[str, dict]:
    """{section: overrides} of one variant; keys outside VARIANT_SECTIONS are train keys."""
    spec = dict(spec or {})
    shared = sorted(set(spec) & set(SHARED_SECTIONS))
    if shared:
        raise PipelineError(f"variants.{name}: {', '.join(shared)} cannot differ between variants (every variant "
                            f"shares them); a variant overrides keys of {', '.join(VARIANT_SECTIONS)}")
    sections = {s: dict(spec.pop(s) or {}) for s in VARIANT_SECTIONS if s in spec}
    if spec:
        both = sorted(set(spec) & set(sections.get("train", {})))
        if both:
            raise PipelineError(f"variants.{name}: {', '.join(both)} given both directly and under train:; "
                                f"keep one")
        sections["train"] = {**spec, **sections.get("train", {})}
    return sections


def variant_config(config: dict, name: str) -> dict:
    """The config as variant `name` sees it: the base sections with its overrides merged in, and
    any `auto` dtype resolved for where the variant's stage runs (pipeline_lib/dtypes.py; the
    workflow's base config is resolved already, so a variant inherits the base's dtype unless it
    sets its own)."""
    merged = dict(config)
    for section, overrides in variant_overrides(name, config["variants"][name]).items():
        merged[section] = {**config[section], **overrides}
    return dtypes.resolve(merged)


def stage_settings(cfg: dict, stage: str) -> dict[str, Any]:
    s = STAGES[stage]
    own = {k: v for k, v in cfg[s.section].items() if k not in s.not_defining}
    return {**own, **s.borrowed(cfg)}


def _chain(cfg: dict, stage: str) -> list[dict]:
    """Settings of `stage` and of every stage it reads, upstream first."""
    reads = STAGES[stage].reads
    return (_chain(cfg, reads) if reads else []) + [stage_settings(cfg, stage)]


def instances_for(config: dict, cfg: dict) -> dict[str, StageInstance]:
    """The stage instances the merged config `cfg` builds on ({stage: instance}, DAG order;
    a stage it does not build, such as hidden states when training online, is left out);
    `config` is the base config, whose instances keep the plain directory names."""
    out: dict[str, StageInstance] = {}
    base = dtypes.resolve(config)  # as variant_config resolves cfg (a no-op on the workflow's config)
    for stage in STAGES.values():
        if not stage.built(cfg):
            continue
        chain = _chain(cfg, stage.name)
        if chain == _chain(base, stage.name):
            directory = stage.name
        else:
            directory = f"{stage.name}-{hashlib.sha256(settings_json(chain).encode()).hexdigest()[:DIGEST_CHARS]}"
        out[stage.name] = StageInstance(stage.name, directory, chain[-1],
                                        out[stage.reads].dir if stage.reads else None)
    return out


def plan_instances(config: dict) -> tuple[dict[str, dict[str, StageInstance]], dict[str, StageInstance]]:
    """({variant: {stage: instance}}, {directory: instance}) for every variant of the config."""
    by_variant = {v: instances_for(config, variant_config(config, v)) for v in sorted(config["variants"])}
    by_dir = {inst.dir: inst for lineage in by_variant.values() for inst in lineage.values()}
    return by_variant, by_dir


def changed_settings(config: dict, name: str) -> dict[str, Any]:
    """{"section.key": value} for every key variant `name` sets to a value other than the
    base config's (what the comparison table lists as the variant's difference)."""
    out = {}
    for section, overrides in variant_overrides(name, config["variants"][name]).items():
        for key, value in sorted(overrides.items()):
            if config[section].get(key) != value:
                out[f"{section}.{key}"] = value
    return out


def check_verify(config: dict) -> None:
    """Verify settings that contradict each other, refused before any job runs."""
    verify = config.get("verify") or {}
    if verify.get("speedup_rounds") == 0 and (verify.get("thresholds") or {}).get("min_speedup") is not None:
        raise PipelineError("verify.thresholds.min_speedup is set while verify.speedup_rounds is 0 (no speedup "
                            "measured): every report would fail that bar. Set speedup_rounds to 2 or more, or "
                            "remove min_speedup")


def check_variants(config: dict, schema: dict) -> None:
    """Validate each variant's merged config against the config schema (no defaults filled:
    the base config already has them), naming the variant and the key on error."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    for name in sorted(config["variants"]):
        error = jsonschema.exceptions.best_match(validator.iter_errors(variant_config(config, name)))
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path)
            raise PipelineError(f"variants.{name}: {where}: {error.message} (a variant overrides keys of "
                                f"{', '.join(VARIANT_SECTIONS)}; see schemas/config.schema.yaml)")
    accelerator = draft_types.verify_accelerator(config)
    for name in sorted(config["variants"]):
        cfg = variant_config(config, name)
        try:
            draft_types.check_type_settings({"draft_type": "eagle3", **cfg["train"]})
        except PipelineError as err:
            raise PipelineError(f"variants.{name}: {err}") from None
        draft_types.check_variant(cfg, name, accelerator)
