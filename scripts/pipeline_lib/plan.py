"""What a run will cost, from the config alone (no model load, no data read): tokens, bytes
and GPU-hours per stage, and whether the bytes fit the free disk under results/.

Estimates are upper bounds where the pipeline caps (every answer hits max_tokens, every row
hits max_seq_len); docs/sizing.md explains each estimate and its assumptions.

Hidden states can be kept three ways (hidden_states.mode / storage); the plan prices each, disk
and GPU-hours, and says which fits when the configured one does not:
- offline bf16: files in the extraction dtype, extracted once;
- offline fp8: hs-connectors' fp8 files, about half the bytes, the same GPU time;
- online: no files; a vLLM server on server_gpus of the training job re-extracts every row
  every epoch, and holds its GPUs for the whole training."""
from __future__ import annotations

import json
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Any

from .acceptance.job import BASELINE_KEYS
from .acceptance.speedup import engines_in_turn
from .hidden_states.formats import FORMATS
from . import dtypes
from .errors import PipelineError
from .io import human_bytes
from .resources import stage_gpus, stage_resources
from .stages import STAGES, plan_instances, trains_online, variant_config

# Throughputs used where the config gives none and the target's parameter count is unknown:
# per GPU, measured on one H200 with the demo's small targets (2026-12-04; docs/results.md, GPU recipe).
DEFAULT_THROUGHPUT = {
    "generation_tokens_per_s": 2000.0,
    "extraction_tokens_per_s": 40000.0,
    "train_tokens_per_s": 60000.0,
}
# With the parameter count known, tokens/s per GPU follow the model's size: a forward pass costs
# about 2 x parameters FLOPs a token (the target: traces, hidden states, synthesis, verification);
# training the draft 6 x its parameters (forward 2 + backward 4; less the embedding copy, a
# lookup) a token per TTT step; at plan.utilization of plan.gpu_peak_tflops.
FORWARD_FLOPS_PER_PARAM = 2
TRAIN_FLOPS_PER_PARAM = 6
# Eval prompts counted where no num_samples caps a set (MT-Bench has 80).
EVAL_PROMPTS_UNCAPPED = 80
# A vLLM engine's start (weights loaded, CUDA graphs captured), held on its job's GPUs: the
# verify stage and the forecast start several, and decode little.
ENGINE_START_S = 300
# Engines the verify stage starts per draft besides the speedup's: the load check, the trained and
# the untrained draft's acceptance; plus one baseline (speedup_engine_starts adds the rounds').
VERIFY_ENGINES_PER_DRAFT = 3
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
    if shape.get("num_parameters") is None and tgt.get("source") == "local" and tgt.get("path"):
        shape["num_parameters"] = safetensors_parameters(Path(tgt["path"]))
    return shape


def safetensors_parameters(model_dir: Path) -> int | None:
    """The parameter count of a model directory's safetensors files, from their headers (no
    weights read); None without any."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(path, framework="numpy") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


def draft_parameters(hidden: int, vocab: int, draft_vocab: int, layers: int, intermediate: int | None) -> int:
    """EAGLE-3 draft size: fc (3H->H), per layer attention over 2H inputs + MLP, lm_head over
    the draft vocab, plus the (frozen) embedding copy."""
    inter = intermediate or 4 * hidden
    per_layer = 2 * hidden * hidden + 2 * (2 * hidden) * hidden + hidden * hidden + 3 * hidden * inter
    return 3 * hidden * hidden + layers * per_layer + hidden * draft_vocab + hidden * vocab


# Bytes per value of each dtype a stage runs the target in.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _weight_bytes(params: int | None, dtype: str | None) -> int | None:
    return params * DTYPE_BYTES[dtype] if params and dtype in DTYPE_BYTES else None


def _split(n: int | None, gpus: int) -> int | None:
    return -(-n // max(1, gpus)) if n is not None else None


def speedup_engine_starts(verify: dict[str, Any], gpus: int) -> int:
    """Engines the speedup rounds start: two kept up together, or one at a time, rounds + 1
    (each switch of arm a start; acceptance/vllm_backend._EnginesInTurn)."""
    rounds = verify.get("speedup_rounds", 3)
    if not rounds:
        return 0
    return rounds + 1 if engines_in_turn(verify.get("speedup_engines", "auto"), max(1, gpus)) else 2


def gpu_memory(config: dict[str, Any], shape: dict[str, Any], variants: dict[str, dict]) -> dict[str, dict]:
    """GPU memory one GPU of each stage's job holds for weights and training state, as the code
    runs the stage ({stage: {"bytes_per_gpu", "gpus", "how"}}; bytes None where the target's
    parameter count is unknown). Not included: vLLM's KV cache (vLLM takes what its
    gpu_memory_utilization leaves after the weights) and activations (training's grow with
    train.total_seq_len x ttt_steps x draft_vocab_size). Estimates:
    - vLLM traces and hidden states: the target in the stage's dtype, split over the job's GPUs
      by tensor parallel; the transformers backends hold it whole on one GPU;
    - training (DDP): every trainer GPU holds the whole draft in fp32 (4 B a parameter, plus a
      gradient and Adam's two moments, 12 B, per trainable one: speculators freezes the copies of
      the target's embedding and lm_head) and the target's lm_head over the draft vocab (frozen,
      for the loss), plus, online, the server's share of the target;
    - verification: the load check and each acceptance engine split over the job's GPUs
      (parallel.py); the speedup's two engines (target alone, target + draft) are up at once,
      each given 0.45 of the card, on one GPU, and in turn on several (speedup.engines_in_turn)."""
    params = shape.get("num_parameters")
    hidden = shape.get("hidden_size")
    vocab = shape.get("vocab_size")
    gpus = partial(stage_gpus, config)
    out: dict[str, dict] = {}
    gen, hs, ver = config["generation"], config["hidden_states"], config["verify"]
    # Traces compute in generation.dtype (resolved; unset: the target's stored dtype).
    traces_dtype = gen.get("dtype") or config["target"].get("dtype")
    n = gpus("traces")
    if gen.get("backend", "vllm") == "openai":
        out["traces"] = {"bytes_per_gpu": 0, "gpus": n, "how": "an OpenAI-compatible endpoint serves the target"}
    elif gen.get("backend", "vllm") == "vllm":
        out["traces"] = {"bytes_per_gpu": _split(_weight_bytes(params, traces_dtype), n), "gpus": n,
                         "how": f"target {traces_dtype}, tensor parallel over {max(1, n)} GPU(s)"}
    else:
        out["traces"] = {"bytes_per_gpu": _weight_bytes(params, traces_dtype), "gpus": n,
                         "how": f"target {traces_dtype}, whole on one GPU (transformers)"}
    n = gpus("hidden_states")
    if hs.get("mode", "offline") != "online":
        split = hs.get("backend", "vllm") == "vllm"
        out["hidden_states"] = {
            "bytes_per_gpu": _split(_weight_bytes(params, hs.get("dtype")), n if split else 1), "gpus": n,
            "how": f"target {hs.get('dtype')}, " + (f"tensor parallel over {max(1, n)} GPU(s)" if split
                                                    else "whole on one GPU (transformers)")}
    n = gpus("train")
    train_bytes = None
    for name in sorted(variants):
        v = variants[name]
        t = variant_config(config, name)["train"]
        if v["draft_parameters"] is None or not hidden:
            continue
        # speculators freezes the copies of the target's embedding and lm_head (over the draft vocab).
        frozen = hidden * (vocab or t["draft_vocab_size"]) + hidden * t["draft_vocab_size"]
        trainable = v["draft_parameters"] - frozen
        states = v["draft_parameters"] * 4 + trainable * 12 + hidden * t["draft_vocab_size"] * 4
        train_bytes = max(train_bytes or 0, states)
    how = f"the draft's fp32 weights, gradients and Adam state on each of {max(1, n)} trainer GPU(s)"
    if any(v["hidden_states_mode"] == "online" for v in variants.values()):
        server = max(1, hs.get("server_gpus") or 0)
        served = _split(_weight_bytes(params, hs.get("dtype")), server)
        train_bytes = None if train_bytes is None or served is None else max(train_bytes, served)
        how += f"; the vLLM server's share of the target on {server} GPU(s)"
    out["train"] = {"bytes_per_gpu": train_bytes, "gpus": n, "how": how}
    n = gpus("verify")
    draft = max((v["draft_parameters"] or 0 for v in variants.values()), default=0)
    target_v = _weight_bytes(params, ver.get("dtype"))
    draft_v = draft * DTYPE_BYTES.get(ver.get("dtype"), 4)
    load_check = _weight_bytes(params, config["target"].get("dtype"))
    if ver.get("backend", "vllm") == "vllm":
        together = not engines_in_turn(ver.get("speedup_engines", "auto"), max(1, n)) and ver.get("speedup_rounds", 3)
        up_at_once = (2 if together else 1) * target_v + draft_v if target_v is not None else None
        need = None if up_at_once is None or load_check is None else _split(max(up_at_once, load_check + draft_v), n)
        how = (f"two acceptance engines at once (target {ver.get('dtype')}, x2, + draft)" if together
               else f"one engine at a time (target {ver.get('dtype')} + draft)") + f", tensor parallel over {max(1, n)} GPU(s)"
    else:
        need = None if target_v is None or load_check is None else max(target_v + draft_v, load_check + draft_v)
        how = f"target {ver.get('dtype')} + draft on one GPU (transformers); the load check in vLLM, one GPU"
    out["verify"] = {"bytes_per_gpu": need, "gpus": n, "how": how}
    return out


def flops_per_s(plan_cfg: dict[str, Any]) -> float:
    """What one GPU computes at the planned utilization (plan.utilization x plan.gpu_peak_tflops)."""
    return plan_cfg.get("utilization", 0.4) * plan_cfg.get("gpu_peak_tflops", 989.0) * 1e12


def assumed_throughput(plan_cfg: dict[str, Any], target_params: int | None) -> tuple[dict[str, float], str]:
    """Tokens/s per GPU of the target's forward stages, and how they were made: the config's
    measured figures (plan.throughput) first, else from the target's size, else the fixed defaults."""
    given = plan_cfg.get("throughput") or {}
    if target_params:
        forward = flops_per_s(plan_cfg) / (FORWARD_FLOPS_PER_PARAM * target_params)
        base = {"generation_tokens_per_s": forward, "extraction_tokens_per_s": forward}
        how = (f"{FORWARD_FLOPS_PER_PARAM} x {target_params:,} parameters FLOPs a token at "
               f"{plan_cfg.get('utilization', 0.4):.0%} of {plan_cfg.get('gpu_peak_tflops', 989.0):g} TFLOP/s")
    else:
        base, how = dict(DEFAULT_THROUGHPUT), "fixed defaults: the target's parameter count is unknown"
    if given:
        how += "; measured: " + ", ".join(sorted(given))
    return {**base, **given}, how


def train_throughput(plan_cfg: dict[str, Any], draft_params: int | None, embedding: int, ttt_steps: int) -> float:
    """Training tokens/s per GPU: the measured figure, else the draft's FLOPs a token (every TTT
    step) at the planned utilization, else the fixed default."""
    given = (plan_cfg.get("throughput") or {}).get("train_tokens_per_s")
    if given or not draft_params:
        return given or DEFAULT_THROUGHPUT["train_tokens_per_s"]
    return flops_per_s(plan_cfg) / (TRAIN_FLOPS_PER_PARAM * (draft_params - embedding) * ttt_steps)


def verify_decoded_tokens(config: dict[str, Any], variants: int) -> int:
    """Tokens the verify stage decodes, at most (every answer max_tokens long): the baseline once
    (eval prompts and each suite), and per draft its acceptance on the same prompts, the untrained
    draft's and the speedup rounds (without and with the draft)."""
    v = config["verify"]
    prompts = v["num_prompts"] or config["prompts"]["eval"].get("num_samples") or EVAL_PROMPTS_UNCAPPED
    suites = sum(s.get("num_samples") or EVAL_PROMPTS_UNCAPPED for s in v.get("suites") or [])
    untrained = v.get("untrained_prompts") or prompts
    rounds = v.get("speedup_rounds", 0) * 2 * (v.get("concurrency_one_prompts", 0) + v.get("speedup_batch_prompts", 0))
    per_draft = prompts + suites + untrained + rounds
    return v["max_tokens"] * (prompts + suites + variants * per_draft)


def forecast_gpu_hours(config: dict[str, Any]) -> float:
    """The forecast holds its GPUs for one server per tau plus the baseline, each measured for
    `seconds` at every concurrency, after its start (ENGINE_START_S)."""
    f = config.get("forecast") or {}
    if not f.get("enabled"):
        return 0.0
    servers = len(f.get("tau") or []) + 1
    per_server = len(f.get("concurrency") or []) * f.get("seconds", 12) + ENGINE_START_S
    return max(1, stage_gpus(config, "forecast")) * servers * per_server / 3600


# The stages whose jobs each run on one node (training may span plan nodes: resources.train.nodes).
SINGLE_NODE_STAGES = ("synthesize", "traces", "hidden_states", "verify", "forecast")


def refusals(config: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """What cannot fit, before any job runs: a stage whose job asks for more GPUs than a node
    has (plan.gpus_per_node), or whose GPUs cannot hold what the code puts on each of them
    (plan.gpu_memory_gb; weights and training state only, so the KV cache still needs room)."""
    plan_cfg = config.get("plan") or {}
    per_node, memory_gb = plan_cfg.get("gpus_per_node", 8), plan_cfg.get("gpu_memory_gb", 80)
    found = []
    for stage in SINGLE_NODE_STAGES + ("train",):
        res = stage_resources(config, stage)
        gpus, nodes = int(res.get("gpu") or 0), int(res.get("nodes") or 1) if stage == "train" else 1
        pipeline = int(res.get("pipeline_parallel") or 1)
        if gpus and gpus % pipeline:
            found.append(f"{stage}: resources.{stage}.pipeline_parallel = {pipeline} does not divide "
                         f"resources.{stage}.gpu = {gpus}: tensor parallel takes the job's GPUs / pipeline_parallel")
        if -(-gpus // nodes) > per_node:
            where = f" over resources.train.nodes = {nodes}" if nodes > 1 else ""
            found.append(f"{stage}: resources.{stage}.gpu = {gpus}{where} needs {-(-gpus // nodes)} GPUs on one node, "
                         f"but a node has {per_node} (plan.gpus_per_node): give the stage at most {per_node * nodes} "
                         + ("or raise resources.train.nodes" if stage == "train" else "GPUs"))
    for stage, need in plan["gpu_memory"].items():
        if need["gpus"] and need["bytes_per_gpu"] and need["bytes_per_gpu"] > memory_gb * 1e9:
            found.append(f"{stage}: {human_bytes(need['bytes_per_gpu'])} on one GPU ({need['how']}; target "
                         f"{plan['target_shape'].get('num_parameters'):,} parameters) exceeds the {memory_gb} GB of a GPU "
                         f"(plan.gpu_memory_gb) with resources.{stage}.gpu = {need['gpus']}"
                         f": give the stage more GPUs (at most {per_node}, plan.gpus_per_node)")
    return found


def check_fits(config: dict[str, Any], plan: dict[str, Any]) -> None:
    found = refusals(config, plan)
    if found:
        raise PipelineError("the plan refuses this config, it cannot fit the GPUs (no job has run):\n  - "
                            + "\n  - ".join(found))


def synthesized_entries(prompts: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompts.train entries that read the synthesize stage's requests."""
    train = prompts["train"]
    return [e for e in (train if isinstance(train, list) else [train]) if e.get("source") == "synthesized"]


def train_prompt_count(prompts: dict[str, Any], synthesized: int | None = None) -> int | None:
    """Training prompts the config asks for: num_samples, summed over a mix (capped by
    mix_num_samples); None when a cap is missing. A `synthesized` source without a cap counts
    the requests asked for (`synthesized`: synthesize.num_prompts), an upper bound."""
    train = prompts["train"]
    caps = [e.get("num_samples") or (synthesized if e.get("source") == "synthesized" else None)
            for e in (train if isinstance(train, list) else [train])]
    total = None if None in caps else sum(caps)
    if prompts.get("mix_num_samples") is not None:
        total = prompts["mix_num_samples"] if total is None else min(total, prompts["mix_num_samples"])
    return total


def make_plan(config: dict[str, Any], results_dir: str | Path,
              dtype_resolution: dict[str, Any] | None = None) -> dict[str, Any]:
    """`dtype_resolution`: what the `auto` dtypes resolved to (pipeline_lib/dtypes.py); without it,
    the workflow's decision this process inherited, else resolved here."""
    results_dir = Path(results_dir)
    if dtype_resolution is None:
        dtype_resolution = dtypes.planned(config)
    config = dtypes.resolve(config)  # the estimates use the dtype each stage computes in
    plan_cfg = config.get("plan") or {}
    shape = target_shape(config, results_dir)
    hidden = shape.get("hidden_size")
    vocab = shape.get("vocab_size")
    gen, tok, hs = config["generation"], config["tokenize"], config["hidden_states"]
    throughput, throughput_basis = assumed_throughput(plan_cfg, shape.get("num_parameters"))

    synth = config.get("synthesize") or {}
    synthesizes = bool(synthesized_entries(config["prompts"]))
    n_prompts = train_prompt_count(config["prompts"], synth.get("num_prompts")) or plan_cfg.get("num_prompts")
    avg_prompt = plan_cfg.get("avg_prompt_tokens", 128)
    notes = []
    built = results_dir / "prompts" / "train.provenance.json"
    if n_prompts is None and built.exists():
        # A mix entry without num_samples takes every row of its source: once prompts_train has
        # run, its provenance records how many that was (read at parse time: a small file, not the rows).
        n_prompts = (json.loads(built.read_text()).get("counts") or {}).get("written")
        if n_prompts is not None:
            notes.append(f"training prompts counted in {built} (a mix entry without num_samples takes its whole source)")
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
    mode, storage = hs.get("mode", "offline"), hs.get("storage", "bf16")
    # Offline files: storage bf16 keeps float32-computed states as bfloat16 (dtypes.hidden_file_dtype).
    file_dtype = hs["dtype"] if mode == "online" else dtypes.hidden_file_dtype(hs["dtype"])
    per_token = {name: fmt.bytes_per_token(n_aux + 1, hidden, file_dtype) if hidden else None
                 for name, fmt in FORMATS.items()}
    hs_bytes = None
    if hidden:
        hs_bytes = train_tokens * per_token[storage]
    else:
        notes.append("target hidden size unknown until the target is materialized (or set plan.target_shape)")

    variants = {}
    ckpt_total = 0
    train_res = stage_resources(config, "train")
    _, instances = plan_instances(config)
    for name in sorted(config["variants"]):
        cfg = variant_config(config, name)
        t = cfg["train"]
        params = draft_parameters(hidden, vocab or t["draft_vocab_size"], t["draft_vocab_size"], t["draft_layers"],
                                  shape.get("intermediate_size")) if hidden else None
        # bf16 weights per kept epoch + fp32 Adam moments (2x4 bytes) in the latest only.
        ckpt = params * 2 * t["keep_last"] + params * 8 if params else None
        # A data-scaling size trains on its share of the conversations (train.max_conversations).
        share = min(1.0, t["max_conversations"] / n_prompts) if t.get("max_conversations") and n_prompts else 1.0
        rate = train_throughput(plan_cfg, params, (hidden or 0) * (vocab or t["draft_vocab_size"]), t["ttt_steps"])
        gpu_h = train_tokens * share * t["epochs"] / rate / 3600
        online_h = online_train_gpu_hours(round(train_tokens * share), t, cfg["hidden_states"], train_res,
                                          {**throughput, "train_tokens_per_s": rate})
        variants[name] = {"draft_parameters": params, "checkpoint_bytes": ckpt, "epochs": t["epochs"],
                          "train_tokens_per_s": round(rate, 1),
                          "hidden_states_mode": cfg["hidden_states"]["mode"],
                          "offline_train_gpu_hours": round(gpu_h, 3), "online_train_gpu_hours": round(online_h, 3),
                          # what this variant's own mode costs
                          "train_gpu_hours": round(online_h if trains_online(cfg) else gpu_h, 3)}
        ckpt_total += ckpt or 0

    # Variants that change upstream settings add stage instances (pipeline_lib/stages.py).
    per_stage = {stage: [i for i in instances.values() if i.stage == stage] for stage in STAGES}
    jobs = {
        "target": 1, "prompts_train": 1, "prompts_eval": 1,
        "traces_shard": sum(i.settings["num_shards"] for i in per_stage["traces"]),
        "traces_gather": len(per_stage["traces"]), "tokenize": len(per_stage["tokenized"]),
        "hidden_states_shard": sum(i.settings["num_shards"] for i in per_stage["hidden_states"]),
        "hidden_states_gather": len(per_stage["hidden_states"]),
        "train_draft": len(variants), "load_check": len(variants), "contract_checks": len(variants),
        # one baseline per distinct set of its settings (those of the verify section)
        "acceptance_baseline": len({json.dumps([variant_config(config, v)["verify"].get(k) for k in BASELINE_KEYS])
                                    for v in variants}),
        "acceptance": len(variants), "report": len(variants), "compare_variants": 1,
    }
    if config["forecast"].get("enabled"):
        jobs["forecast"] = 1
    if synthesizes:
        jobs.update(synthesize_shard=synth["num_shards"], synthesize_gather=1)
    extra = {stage: len(found) - 1 for stage, found in per_stage.items() if len(found) > 1}
    if extra:
        notes.append("variants with their own upstream settings add " + ", ".join(f"{n} {stage}" for stage, n in extra.items())
                     + " instance(s): the traces and hidden-state tokens, bytes and GPU-hours above are the base "
                       "config's, for one instance each")
    extraction_h = round(train_tokens / throughput["extraction_tokens_per_s"] / 3600, 3)
    gpu_hours = {
        "traces": round(completion_tokens / throughput["generation_tokens_per_s"] / 3600, 3),
        # no extraction when every variant trains online (no hidden-states instance)
        "hidden_states": extraction_h if per_stage["hidden_states"] else 0.0,
        "train": round(sum(v["train_gpu_hours"] for v in variants.values()), 3),
    }
    if synthesizes:
        gpu_hours["synthesize"] = round(synth["num_prompts"] * synth["max_tokens"]
                                        / throughput["generation_tokens_per_s"] / 3600, 3)
    per_draft = VERIFY_ENGINES_PER_DRAFT + speedup_engine_starts(config["verify"], stage_gpus(config, "verify"))
    engines = max(1, stage_gpus(config, "verify")) * (1 + per_draft * len(variants)) * ENGINE_START_S
    gpu_hours["verify"] = round((verify_decoded_tokens(config, len(variants)) / throughput["generation_tokens_per_s"]
                                 + engines) / 3600, 3)
    gpu_hours["forecast"] = round(forecast_gpu_hours(config), 3)
    # What every hidden-state option costs besides traces, extraction and training.
    other_h = gpu_hours.get("synthesize", 0.0) + gpu_hours["verify"] + gpu_hours["forecast"]
    free = plan_cfg.get("disk_free_bytes")
    if free is None:
        free = shutil.disk_usage(results_dir if results_dir.exists() else Path(".")).free
    options = hidden_state_options(train_tokens, per_token, ckpt_total, gpu_hours["traces"] + other_h, extraction_h,
                                   variants, free)
    chosen = option_name(mode, storage)
    estimated_bytes = options[chosen]["disk_bytes"]
    plan = {
        "run_name": config["run_name"],
        "target_shape": shape,
        "jobs": jobs,
        "resources": {stage: stage_resources(config, stage)
                      for stage in ("default", "synthesize", "traces", "hidden_states", "train", "verify", "forecast")},
        "prompts": n_prompts,
        "trace_completion_tokens_max": completion_tokens,
        "train_tokens_max": train_tokens,
        "hidden_states_mode": mode,
        "hidden_states_storage": storage,
        "hidden_state_bytes": 0 if mode == "online" else hs_bytes,
        "hidden_state_bytes_per_token": per_token[storage],
        "hidden_state_bytes_per_token_by_storage": per_token,
        "hidden_state_options": options,
        "variants": variants,
        "checkpoint_bytes_total": ckpt_total,
        "gpu_hours": gpu_hours,
        "gpu_memory": gpu_memory(config, shape, variants),
        "dtypes": dtype_resolution,
        "throughput_assumed": throughput,
        "throughput_basis": throughput_basis,
        "free_disk_bytes": free,
        "fits_disk": estimated_bytes <= free,
        "notes": notes,
    }
    if not plan["fits_disk"]:
        notes.append(f"estimated {human_bytes(estimated_bytes)} (hidden states + checkpoints, with margin) "
                     f"exceeds the {human_bytes(free)} free under {results_dir}: free space or move results/")
        fitting = [name for name, o in options.items() if o["fits"]]
        base = options[chosen]["gpu_hours_total"]
        if fitting:
            notes.append("what fits instead: " + "; ".join(
                f"{name} (hidden_states: {{mode: {o['mode']}, storage: {o['storage']}}}) needs "
                f"{human_bytes(o['disk_bytes'])} and {o['gpu_hours_total']} GPU-hours "
                f"({o['gpu_hours_total'] - base:+.1f} vs {chosen})" for name, o in
                ((n, options[n]) for n in fitting)))
        else:
            notes.append("no hidden-state option fits: even online training needs "
                         f"{human_bytes(options['online']['disk_bytes'])} for checkpoints")
    plan["forecast"] = forecast_status(config, Path(results_dir))
    return plan


def forecast_status(config: dict[str, Any], results_dir: Path) -> dict[str, Any]:
    """The speedup forecast's file, and once it exists its break-even tau per concurrency."""
    path = results_dir / "forecast" / "forecast.json"
    status: dict[str, Any] = {"path": str(path), "enabled": bool((config.get("forecast") or {}).get("enabled")),
                              "exists": path.exists()}
    if status["exists"]:
        try:
            record = json.loads(path.read_text())
            status.update(break_even=record.get("break_even"), is_forecast=record.get("is_forecast"),
                          accelerator=(record.get("accelerator") or {}).get("model"))
        except (OSError, ValueError) as err:  # a plan never fails on a record it only reports
            status["error"] = f"{path}: unreadable ({err})"
    return status


def forecast_lines(f: dict[str, Any]) -> list[str]:
    from .forecast.curve import break_even_text

    if not f["exists"]:
        how = "in the default target (forecast.enabled)" if f["enabled"] else f"not enabled: snakemake {f['path']}"
        return [f"  speedup forecast: {f['path']} not built yet ({how})"]
    if f.get("error"):
        return [f"  speedup forecast: {f['error']}"]
    be = ", ".join(f"{n} in flight {break_even_text(v)}" for n, v in (f.get("break_even") or {}).items())
    kind = f"on {f['accelerator']}" if f.get("is_forecast") else "NOT a forecast (measured on a CPU)"
    return [f"  speedup forecast ({f['path']}, {kind}): break-even tau {be}"]


def option_name(mode: str, storage: str) -> str:
    return "online" if mode == "online" else f"offline {storage}"


def online_train_gpu_hours(train_tokens: int, train: dict, hs: dict, res: dict, throughput: dict) -> float:
    """GPU-hours of one online training job: the trainer's work, plus the server re-extracting
    every row (train and validation) every epoch, with the server's GPUs held the whole time.
    With dataloader workers the two overlap (the slower one sets the pace); without, they add."""
    server = max(1, hs.get("server_gpus") or 0)
    trainer = max(1, (res.get("gpu") or 0) - (hs.get("server_gpus") or 0))
    tokens = train_tokens * train["epochs"]
    train_h = tokens / throughput["train_tokens_per_s"] / 3600 / trainer
    extract_h = tokens / throughput["extraction_tokens_per_s"] / 3600 / server
    wall = max(train_h, extract_h) if train.get("num_workers", 0) > 0 else train_h + extract_h
    return wall * (trainer + server)


def hidden_state_options(train_tokens: int, per_token: dict, ckpt_total: int, traces_h: float, extraction_h: float,
                         variants: dict, free: int) -> dict[str, dict]:
    """Disk and GPU-hours of each way to keep hidden states (offline per storage format, online),
    as if every variant used it."""
    offline_train = round(sum(v["offline_train_gpu_hours"] for v in variants.values()), 3)
    offline_gpu_h = traces_h + extraction_h + offline_train
    online_train = round(sum(v["online_train_gpu_hours"] for v in variants.values()), 3)
    options = {}
    for storage, bpt in per_token.items():
        disk = (train_tokens * bpt if bpt else 0) * 2 + ckpt_total  # store + (hard-linked) data dir ~ 1x; 2x margin
        options[option_name("offline", storage)] = {
            "mode": "offline", "storage": storage, "hidden_state_bytes": train_tokens * bpt if bpt else None,
            "disk_bytes": disk, "gpu_hours_train": offline_train,
            "gpu_hours_total": round(offline_gpu_h, 3), "fits": disk <= free}
    options["online"] = {
        "mode": "online", "storage": "bf16 or fp8", "hidden_state_bytes": 0, "disk_bytes": ckpt_total,
        "gpu_hours_train": online_train, "gpu_hours_total": round(traces_h + online_train, 3),
        "fits": ckpt_total <= free}
    return options


def format_plan(plan: dict[str, Any]) -> str:
    lines = [f"Plan for run '{plan['run_name']}' (estimates are upper bounds; no job has run):"]
    lines.append("  jobs per rule (threads / mem_mb / runtime min / gpu):")
    stage_of = {"synthesize_shard": "synthesize", "traces_shard": "traces", "hidden_states_shard": "hidden_states",
                "train_draft": "train", "acceptance_baseline": "verify",
                "acceptance": "verify", "load_check": "verify", "forecast": "forecast"}
    for rule, n in plan["jobs"].items():
        r = plan["resources"][stage_of.get(rule, "default")]
        lines.append(f"    {rule:<22} x{n:<5} {r.get('threads')} / {r.get('mem_mb')} / {r.get('runtime')} / {r.get('gpu')}")
    s = plan["target_shape"]
    lines.append(f"  target: hidden {s.get('hidden_size')}, layers {s.get('num_hidden_layers')}, vocab {s.get('vocab_size')}")
    if plan.get("dtypes"):
        cpu = plan["dtypes"].get("cpu") or {}
        lines.append("  compute dtypes (auto: bfloat16 on a GPU; on a CPU bfloat16 only with native bf16; this CPU's bf16: "
                     + ("native" if cpu.get("native") else "emulated") + f", {cpu.get('basis')}):")
        lines += [f"    {line}" for line in dtypes.describe(plan["dtypes"])]
    lines.append(f"  traces: {plan['prompts']} prompts, <= {plan['trace_completion_tokens_max']:,} generated tokens")
    if plan["hidden_states_mode"] == "online":
        lines.append(f"  hidden states: online (a vLLM server in each training job), <= {plan['train_tokens_max']:,} "
                     f"tokens per epoch, nothing on disk")
    else:
        lines.append(f"  hidden states: <= {plan['train_tokens_max']:,} tokens x {human_bytes(plan['hidden_state_bytes_per_token'])}/token"
                     f" = {human_bytes(plan['hidden_state_bytes'])} ({plan['hidden_states_storage']})")
    by_storage = [f"{o['storage']} {human_bytes(o['hidden_state_bytes'])} ({human_bytes(plan['hidden_state_bytes_per_token_by_storage'][o['storage']])}/token)"
                  for o in plan["hidden_state_options"].values() if o["mode"] == "offline"]
    lines.append("  hidden states by storage: " + ", ".join(by_storage))
    lines.append("  hidden-state options (disk with margin + checkpoints / GPU-hours in total):")
    for name, o in plan["hidden_state_options"].items():
        mark = " <- configured" if name == option_name(plan["hidden_states_mode"], plan["hidden_states_storage"]) else ""
        lines.append(f"    {name:<13} {human_bytes(o['disk_bytes']):>9} / {o['gpu_hours_total']:>10} GPU-h"
                     f"  {'fits' if o['fits'] else 'DOES NOT FIT'}{mark}")
    for name, v in plan["variants"].items():
        lines.append(f"  draft '{name}': {v['draft_parameters'] or 0:,} params, checkpoints {human_bytes(v['checkpoint_bytes'])},"
                     f" {v['epochs']} epochs")
    g = plan["gpu_hours"]
    synthesis = f"synthesize {g['synthesize']}, " if "synthesize" in g else ""
    lines.append(f"  GPU-hours: {synthesis}traces {g['traces']}, hidden states {g['hidden_states']}, training {g['train']}, "
                 f"verification {g['verify']}, forecast {g['forecast']}")
    rates = ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:,.0f}" for k, v in plan["throughput_assumed"].items()
                      if k != "train_tokens_per_s")
    trains = ", ".join(f"'{n}' {v['train_tokens_per_s']:,.0f}" for n, v in plan["variants"].items())
    lines.append(f"    tokens/s per GPU: {rates}; training {trains} ({plan['throughput_basis']}; "
                 f"training: {TRAIN_FLOPS_PER_PARAM} x the draft's parameters a token per TTT step)")
    on_gpu = {stage: m for stage, m in plan["gpu_memory"].items() if m["gpus"]}
    if not on_gpu:
        lines.append("  GPU memory: none, every stage runs on CPU (resources.<stage>.gpu: 0)")
    else:
        lines.append("  GPU memory per GPU, weights and training state only (KV cache and activations on top)"
                     + ("" if plan["target_shape"].get("num_parameters") else
                        "; the target's size is unknown until it is materialized (or set "
                        "plan.target_shape.num_parameters)") + ":")
        for stage, m in plan["gpu_memory"].items():
            size = human_bytes(m["bytes_per_gpu"]) if m["gpus"] else "CPU"
            lines.append(f"    {stage:<14} {size:>9}  ({m['how'] if m['gpus'] else 'resources.' + stage + '.gpu: 0'})")
    lines.append(f"  disk: {human_bytes(plan['free_disk_bytes'])} free under results/ -> "
                 + ("fits" if plan["fits_disk"] else "DOES NOT FIT"))
    lines += forecast_lines(plan["forecast"])
    for note in plan["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
