#!/usr/bin/env python
"""Load a trained draft in real vLLM as the speculator of its target (by its draft type:
EAGLE-3, P-EAGLE, DFlash, ...) and generate.

When vLLM builds the engine with the draft, writes --out: {"ok", "checks", "tokens",
"seconds", "vllm_version", "spec_decode": {...}, "verifier_path": {...}, ...}. `checks` are
  generated                   the engine produced tokens with the draft attached
  drafted                     the draft proposed tokens (one that never drafts is a silent no-op)
  verifier_path_resolves      the draft dir's own verifier path leads to this target (what
                              `vllm serve <draft dir>` loads; results/ may have moved)
and `ok` is true only when all hold; otherwise the file is still written, the failed checks
are named and the job exits 1. When vLLM cannot load the draft at all it exits 2 with vLLM's
own message and writes nothing.

    python scripts/load_check.py --target results/R/target/model \\
        --draft results/R/drafts/default/final --out results/R/drafts/default/load_check.json
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, draft_types, parallel, runtime  # noqa: E402
from pipeline_lib import target as target_lib  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json  # noqa: E402

PROMPTS = [
    "The quickest way to learn a new language is",
    "Here is a short story about a lighthouse keeper:",
    "Three tips for writing clear documentation:",
]
MAX_MODEL_LEN = 512  # a load check needs no long context; keeps the KV cache small on CPU


def check_draft_dir(draft: Path, expected_type: str) -> tuple[dict, draft_types.DraftType]:
    """The speculators-format fields vLLM needs; refuse early with a message that says which."""
    path = draft / "config.json"
    if not path.exists():
        raise PipelineError(f"{path}: missing; --draft must be a speculators checkpoint dir "
                            f"(drafts/<variant>/final or untrained)")
    config = json.loads(path.read_text())
    if config.get("speculators_model_type") != expected_type:
        raise PipelineError(f"{path}: speculators_model_type = {config.get('speculators_model_type')!r}, "
                            f"expected {expected_type!r} (the variant's train.draft_type)")
    draft_type = draft_types.get(expected_type)
    if not config.get(draft_type.aux_layers_key):
        raise PipelineError(f"{path}: {draft_type.aux_layers_key} is missing; vLLM would silently "
                            f"use its default layers. Re-run train_draft")
    if not list(draft.glob("*.safetensors")):
        raise PipelineError(f"{draft}: no .safetensors weights")
    return config, draft_type


def verifier_path_status(draft: Path, target: Path) -> dict:
    """The draft's stored verifier path, resolved the way vLLM resolves it when the draft dir is
    served as the model itself (`cd final && vllm serve .`): relative to the cwd. (Given through
    speculative_config, as in this check, vLLM does not read it at all.)"""
    from vllm.transformers_utils.config import maybe_override_with_speculators

    cwd = os.getcwd()
    os.chdir(draft)
    try:
        model, _, spec = maybe_override_with_speculators(".", None, trust_remote_code=False)
        resolved = Path(model).resolve()
    finally:
        os.chdir(cwd)
    return {"name_or_path": model, "relative": not os.path.isabs(model),
            "served_standalone_resolves_to": str(resolved),
            "resolves_to_target": resolved == target.resolve(), "method": (spec or {}).get("method")}


def spec_decode_counts(metrics) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    out = {}
    for m in metrics:
        if m.name.startswith("vllm:spec_decode"):
            key = m.name.removeprefix("vllm:spec_decode_")
            if isinstance(m, Counter):
                out[key] = out.get(key, 0) + m.value
            elif isinstance(m, Vector):
                out[key] = [a + b for a, b in zip(out.get(key, [0] * len(m.values)), m.values)]
    drafts = out.get("num_drafts", 0)
    if drafts:
        out["mean_acceptance_length"] = 1 + out.get("num_accepted_tokens", 0) / drafts
    return out


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, help="target model dir")
    p.add_argument("--draft", required=True, help="speculators checkpoint dir")
    p.add_argument("--draft-type", default="eagle3", choices=sorted(draft_types.DRAFT_TYPES),
                   help="the type the draft must be (the variant's train.draft_type)")
    p.add_argument("--out", required=True, help="load_check.json to write")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    args = p.parse_args()

    target, draft = Path(args.target), Path(args.draft)
    target_config = target_lib.load_config(target)
    draft_config, draft_type = check_draft_dir(draft, args.draft_type)
    runtime.setup()
    layout = parallel.decide().apply()
    # The engine in this process, on GPU too: vLLM's own exception reaches us (not "engine core
    # failed, see above") and a 2-core CPU machine starts it in seconds instead of a minute.
    runtime.vllm_engine_in_process(on_gpu_too=True)
    import vllm
    from vllm import LLM, SamplingParams

    speculative_config = draft_type.speculative_config(str(draft), args.num_speculative_tokens)
    max_len = min(MAX_MODEL_LEN, int(target_lib.text_config(target_config).get("max_position_embeddings") or MAX_MODEL_LEN))
    started = time.time()
    try:
        llm = LLM(model=str(target), speculative_config=speculative_config, enforce_eager=True,
                  max_model_len=max_len, seed=0, disable_log_stats=False, trust_remote_code=False,
                  **layout.engine_kwargs())
        load_s = time.time() - started
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        spec = spec_decode_counts(llm.get_metrics())
    except Exception as err:  # vLLM raises many types; its message is what the user needs
        raise PipelineError(f"vLLM could not run {draft} as the {draft_type.title} draft of {target}: "
                            f"{type(err).__name__}: {err}") from None
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    verifier = verifier_path_status(draft, target)
    checks = {"generated": tokens > 0, "drafted": bool(spec.get("num_drafts")),
              "verifier_path_resolves": verifier["resolves_to_target"]}
    result = {
        "ok": all(checks.values()), "checks": checks, "tokens": tokens, "prompts": len(PROMPTS),
        "seconds": round(time.time() - started, 3), "load_seconds": round(load_s, 3),
        "vllm_version": vllm.__version__, "draft": str(draft), "target": str(target),
        "speculative_config": speculative_config, "spec_decode": spec, "parallel": layout.provenance(),
        "draft_vocab_size": draft_config.get("draft_vocab_size"),
        "draft_type": draft_type.name,
        "aux_layer_ids": draft_config.get(draft_type.aux_layers_key),
        "verifier_path": verifier,
        "sample": outputs[0].outputs[0].text if tokens else "",
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],  # greedy: what another layout must equal
    }
    atomic_write_json(args.out, result)
    if not result["ok"]:
        advice = {"generated": "vLLM generated no tokens with the draft attached",
                  "drafted": f"the draft proposed no tokens (spec decode metrics: {spec}): the speculator "
                             f"is not active",
                  "verifier_path_resolves": f"{draft}/config.json's verifier path resolves to "
                                            f"{verifier['served_standalone_resolves_to']}, not {target}: serving "
                                            f"the draft dir on its own would load another target; re-run train_draft"}
        print("load check FAILED: " + "; ".join(advice[k] for k, ok in checks.items() if not ok)
              + f" (details in {args.out})", file=sys.stderr, flush=True)
        return 1
    print(f"load check ok: {tokens} tokens, {spec.get('num_drafts')} drafts, mean acceptance "
          f"length {spec.get('mean_acceptance_length', 0):.2f}, {result['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
