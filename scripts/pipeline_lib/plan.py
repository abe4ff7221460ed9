"""What a run will cost, from the config alone (no model load, no data read): tokens, bytes
and GPU-hours per stage, and whether the bytes fit the free disk under results/.

Estimates are upper bounds where the pipeline caps (every answer hits max_tokens, every row
hits max_seq_len); the README says how far the demo's estimate was from the measured bytes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .stages import STAGES, plan_instances, variant_config

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Throughputs used when the config gives none: per GPU, measured on one H200 (see README).
DEFAULT_THROUGHPUT = {
    "generation_tokens_per_s": 2000.0,
    "extraction_tokens_per_s": 40000.0,
    "train_tokens_per_s": 60000.0,
}
GPU_STAGES = {"traces": "traces_shard", "hidden_states": "hidden_states_shard", "train": "train_draft",
              "verify": "acceptance"}


def target_shape(config: dict[str, Any], results_dir: Path) -> dict[str, Any]:
    """Target dimensions: the plan config's description, else the materialized target's
    manifest, else a local target's config.json. None where unknown."""
    shape = dict((config.get("plan") or {}).get("target_shape") or {})
    manifest = results_dir / "target" / "manifest.json"
    sources = []
    if manifest.exists():
        sources.append(json.loads(manifest.read_text()))
    tgt = config.get("target", {})
    if tgt.get("source") == "local" and tgt.get("path"):
        cfg = Path(tgt["path"]) / "config.json"
        if cfg.exists():
            c = json.loads(cfg.read_text())
            sources.append(c.get("text_config") or c)
    for src in sources:
        for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_parameters"):
            if shape.get(key) is None and src.get(key) is not None:
                shape[key] = src[key]
    return shape


def draft_parameters(hidden: int, vocab: int, draft_vocab: int, layers: int, intermediate: int | None) -> int:
    """EAGLE-3 draft size: fc (3H->H), per layer attention over 2H inputs + MLP, lm_head over
    the draft vocab, plus the (frozen) embedding copy."""
    inter = intermediate or 4 * hidden
    per_layer = 2 * hidden * hidden + 2 * (2 * hidden) * hidden + hidden * hidden + 3 * hidden * inter
    return 3 * hidden * hidden + layers * per_layer + hidden * draft_vocab + hidden * vocab


def train_prompt_count(prompts: dict[str, Any]) -> int | None:
    """Training prompts the config asks for: num_samples, summed over a mix (capped by
    mix_num_samples); None when a cap is missing."""
    train = prompts["train"]
    caps = [e.get("num_samples") for e in (train if isinstance(train, list) else [train])]
    total = None if None in caps else sum(caps)
    if prompts.get("mix_num_samples") is not None:
        total = prompts["mix_num_samples"] if total is None else min(total, prompts["mix_num_samples"])
    return total


def make_plan(config: dict[str, Any], results_dir: str | Path) -> dict[str, Any]:
    results_dir = Path(results_dir)
    plan_cfg = config.get("plan") or {}
    shape = target_shape(config, results_dir)
    hidden = shape.get("hidden_size")
    n_layers = shape.get("num_hidden_layers")
    vocab = shape.get("vocab_size")
    gen, tok, hs, verify = config["generation"], config["tokenize"], config["hidden_states"], config["verify"]
    throughput = {**DEFAULT_THROUGHPUT, **(plan_cfg.get("throughput") or {})}

    n_prompts = train_prompt_count(config["prompts"]) or plan_cfg.get("num_prompts")
    avg_prompt = plan_cfg.get("avg_prompt_tokens", 128)
    notes = []
    if n_prompts is None:
        notes.append("prompts.train.num_samples is null: set it or plan.num_prompts to size the run")
        n_prompts = 0
    # Answers per conversation: 1, or up to max_turns user turns with generation.turns: all.
    turns = 1 if gen.get("turns", "first") == "first" else gen.get("max_turns")
    if turns is None:
        notes.append("generation.turns is all and max_turns is null: the estimates count one answer per "
                     "conversation; set generation.max_turns to size multi-turn runs")
        turns = 1
    completion_tokens = n_prompts * gen["max_tokens"] * turns
    row_tokens = min(avg_prompt * turns + gen["max_tokens"] * turns, tok["max_seq_len"])
    train_tokens = n_prompts * row_tokens
    n_aux = len(hs["aux_layer_ids"]) if hs.get("aux_layer_ids") else 3
    hs_bytes = None
    if hidden:
        hs_bytes = train_tokens * (n_aux + 1) * hidden * DTYPE_BYTES[hs["dtype"]]
    else:
        notes.append("target hidden size unknown until the target is materialized (or set plan.target_shape)")

    variants = {}
    ckpt_total = 0
    _, instances = plan_instances(config)
    for name in sorted(config["variants"]):
        t = variant_config(config, name)["train"]
        params = draft_parameters(hidden, vocab or t["draft_vocab_size"], t["draft_vocab_size"], t["draft_layers"],
                                  shape.get("intermediate_size")) if hidden else None
        # bf16 weights per kept epoch + fp32 Adam moments (2x4 bytes) in the latest only.
        ckpt = params * 2 * t["keep_last"] + params * 8 if params else None
        gpu_h = train_tokens * t["epochs"] / throughput["train_tokens_per_s"] / 3600
        variants[name] = {"draft_parameters": params, "checkpoint_bytes": ckpt, "epochs": t["epochs"],
                          "train_gpu_hours": round(gpu_h, 3)}
        ckpt_total += ckpt or 0

    res = config.get("resources", {})

    def stage_res(stage):
        return {**(res.get("default") or {}), **(res.get(stage) or {})}

    # Variants that change upstream settings add stage instances (pipeline_lib/stages.py).
    per_stage = {stage: [i for i in instances.values() if i.stage == stage] for stage in STAGES}
    jobs = {
        "target": 1, "prompts_train": 1, "prompts_eval": 1,
        "traces_shard": sum(i.settings["num_shards"] for i in per_stage["traces"]),
        "traces_gather": len(per_stage["traces"]), "tokenize": len(per_stage["tokenized"]),
        "hidden_states_shard": sum(i.settings["num_shards"] for i in per_stage["hidden_states"]),
        "hidden_states_gather": len(per_stage["hidden_states"]),
        "train_draft": len(variants), "load_check": len(variants), "contract_checks": len(variants),
        "acceptance": len(variants), "report": len(variants), "compare_variants": 1,
    }
    extra = {stage: len(found) - 1 for stage, found in per_stage.items() if len(found) > 1}
    if extra:
        notes.append("variants with their own upstream settings add " + ", ".join(f"{n} {stage}" for stage, n in extra.items())
                     + " instance(s): the traces and hidden-state tokens, bytes and GPU-hours above are the base "
                       "config's, for one instance each")
    gpu_hours = {
        "traces": round(completion_tokens / throughput["generation_tokens_per_s"] / 3600, 3),
        "hidden_states": round(train_tokens / throughput["extraction_tokens_per_s"] / 3600, 3),
        "train": round(sum(v["train_gpu_hours"] for v in variants.values()), 3),
    }
    estimated_bytes = (hs_bytes or 0) * 2 + ckpt_total  # store + (hard-linked) data dir ~ 1x; 2x margin
    free = shutil.disk_usage(results_dir if results_dir.exists() else Path(".")).free
    plan = {
        "run_name": config["run_name"],
        "target_shape": shape,
        "jobs": jobs,
        "resources": {stage: stage_res(stage) for stage in ("default", "traces", "hidden_states", "train", "verify")},
        "prompts": n_prompts,
        "trace_completion_tokens_max": completion_tokens,
        "train_tokens_max": train_tokens,
        "hidden_state_bytes": hs_bytes,
        "hidden_state_bytes_per_token": (n_aux + 1) * hidden * DTYPE_BYTES[hs["dtype"]] if hidden else None,
        "variants": variants,
        "checkpoint_bytes_total": ckpt_total,
        "gpu_hours": gpu_hours,
        "throughput_assumed": throughput,
        "free_disk_bytes": free,
        "fits_disk": estimated_bytes <= free,
        "notes": notes,
    }
    if not plan["fits_disk"]:
        notes.append(f"estimated {human_bytes(estimated_bytes)} (hidden states + checkpoints, with margin) "
                     f"exceeds the {human_bytes(free)} free under {results_dir}: free space or move results/")
    return plan


def human_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"


def format_plan(plan: dict[str, Any]) -> str:
    lines = [f"Plan for run '{plan['run_name']}' (estimates are upper bounds; no job has run):"]
    lines.append("  jobs per rule (threads / mem_mb / runtime min / gpu):")
    stage_of = {"traces_shard": "traces", "hidden_states_shard": "hidden_states", "train_draft": "train",
                "acceptance": "verify", "load_check": "verify"}
    for rule, n in plan["jobs"].items():
        r = plan["resources"][stage_of.get(rule, "default")]
        lines.append(f"    {rule:<22} x{n:<5} {r.get('threads')} / {r.get('mem_mb')} / {r.get('runtime')} / {r.get('gpu')}")
    s = plan["target_shape"]
    lines.append(f"  target: hidden {s.get('hidden_size')}, layers {s.get('num_hidden_layers')}, vocab {s.get('vocab_size')}")
    lines.append(f"  traces: {plan['prompts']} prompts, <= {plan['trace_completion_tokens_max']:,} generated tokens")
    lines.append(f"  hidden states: <= {plan['train_tokens_max']:,} tokens x {human_bytes(plan['hidden_state_bytes_per_token'])}/token"
                 f" = {human_bytes(plan['hidden_state_bytes'])}")
    for name, v in plan["variants"].items():
        lines.append(f"  draft '{name}': {v['draft_parameters'] or 0:,} params, checkpoints {human_bytes(v['checkpoint_bytes'])},"
                     f" {v['epochs']} epochs")
    g = plan["gpu_hours"]
    lines.append(f"  GPU-hours: traces {g['traces']}, hidden states {g['hidden_states']}, training {g['train']}"
                 f" (at {plan['throughput_assumed']})")
    lines.append(f"  disk: {human_bytes(plan['free_disk_bytes'])} free under results/ -> "
                 + ("fits" if plan["fits_disk"] else "DOES NOT FIT"))
    for note in plan["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
