#!/usr/bin/env python
"""Check that a trained draft honours the contract between the pipeline's stages and what
vLLM's speculators loader expects, before anyone measures or ships it.

Writes contract.json: {"passed", "summary", "checks": [{name, passed, expected, seen, detail,
required}], "reference"}. `passed` is true only if every required check passed; a check that
could not run because an earlier one failed has passed = null. The train-vs-serve check
(training_data.matches_serving_render) needs vLLM: where vLLM is not installed it is reported
as not run, saying why, and informational (required false), so such a box can still build.
A broken draft (no config.json,
another speculator type, random embeddings, ...) is a result, not a crash: the script writes
contract.json and exits 0; make_report decides whether the build fails. Missing pipeline
inputs other than the draft (manifests, stats) are errors (exit 2).

    python scripts/check_contract.py --settings '{}' --target R/target/model \\
        --target-manifest R/target/manifest.json --draft R/drafts/default/final \\
        --hs-manifest R/hidden_states/manifest.json --tokenized-stats R/tokenized/stats.json \\
        --hs-record R/drafts/default/hidden_states.json --tokenized-data R/tokenized/data \\
        --traces R/traces/traces.jsonl --out R/drafts/default/verify/contract.json

With online training (hidden_states.mode: online) --hs-manifest is the train job's
hidden_states.json too: the layer ids its vLLM server extracted.

Settings (config.yaml `verify`): reference_draft (a checkpoint dir compared side by side;
differences are reported, they do not fail the contract); serve_render_rows (tokenized rows,
evenly spaced, whose prompts are compared with vLLM's render; null = all). From the tokenized
instance: chat_template_kwargs (rendered as generation and tokenize did) and trust_remote_code.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.assets import resolve_asset  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json, read_json, read_jsonl  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.secrets import scrub_obj  # noqa: E402
from pipeline_lib.target import load_config, load_manifest, num_layers, text_config  # noqa: E402

# Names speculators gives EAGLE-3 checkpoints (the config default, and what save_pretrained
# writes from the model class); vLLM itself keys on speculators_model_type.
EAGLE3_ARCHITECTURES = {"Eagle3Speculator", "Eagle3DraftModel"}
# Decoder-layer types vLLM's speculators loader maps to an Eagle3 model (algos.update_eagle3).
VLLM_EAGLE3_LAYER_TYPES = {"llama", "qwen3"}
# Where a target keeps its input embeddings (plain, and nested multimodal layouts).
EMBED_NAMES = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "embed_tokens.weight"]


@dataclass
class Check:
    name: str
    passed: bool | None
    expected: Any = None
    seen: Any = None
    detail: str = ""
    required: bool = True


class NotRun(Exception):
    """A check cannot run because something it needs is missing or failed earlier."""


# ---------------------------------------------------------------------------------------------
# What the checks read


def safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


class Weights:
    """Lazy view of a checkpoint's safetensors: names, shapes, dtypes; tensors on demand."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self.files = safetensors_files(model_dir)
        if not self.files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
        self._where: dict[str, Path] = {}
        self._raw: dict[str, str] = {}   # normalized name -> name in the file
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, str] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    key = name.replace("midlayer.", "layers.0.")  # older EAGLE-3 name vLLM also maps
                    self._where[key] = f
                    self._raw[key] = name
                    self.shapes[key] = list(sl.get_shape())
                    self.dtypes[key] = sl.get_dtype()

    def tensor(self, name: str):
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as st:
            return st.get_tensor(self._raw[name])


@dataclass
class Context:
    draft: Path
    target: Path
    target_config: dict
    target_manifest: dict
    hs_manifest: dict
    stats: dict
    settings: dict
    hs_record: dict | None = None   # what train_draft says it trained on (drafts/<v>/hidden_states.json)
    tokenized_data: Path | None = None  # R/tokenized/data (speculators' rows) and the traces they came from
    traces: Path | None = None
    draft_config: dict | None = None
    config_error: str | None = None
    _weights: Any = None
    _weights_error: str | None = None

    @property
    def tc(self) -> dict:
        return text_config(self.target_config)

    def config(self) -> dict:
        if self.draft_config is None:
            raise NotRun(f"draft config.json unusable ({self.config_error})")
        return self.draft_config

    def eagle3_config(self) -> dict:
        cfg = self.config()
        if cfg.get("speculators_model_type") != "eagle3":
            raise NotRun("the draft is not an EAGLE-3 speculator (see config.speculators_model_type)")
        return cfg

    def layer_config(self) -> dict:
        tl = self.eagle3_config().get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise NotRun("transformer_layer_config missing (see config.transformer_layer_config)")
        return tl

    def weights(self) -> Weights:
        if self._weights is None and self._weights_error is None:
            try:
                self._weights = Weights(self.draft)
            except Exception as err:  # unreadable/truncated file: reported by weights.readable
                self._weights_error = f"{type(err).__name__}: {err}"
        if self._weights is None:
            raise NotRun(f"draft weights unreadable ({self._weights_error})")
        return self._weights


def load_draft_config(ctx: Context) -> None:
    path = ctx.draft / "config.json"
    if not path.exists():
        ctx.config_error = f"{path} not found"
        return
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        ctx.config_error = f"{path} is not valid JSON ({err})"
        return
    if not isinstance(cfg, dict):
        ctx.config_error = f"{path} is not a JSON object"
        return
    ctx.draft_config = cfg


# ---------------------------------------------------------------------------------------------
# The checks, registered in report order. Each returns a Check (or raises NotRun).

CHECKS: list[tuple[str, Callable[["Context"], Check]]] = []


def check(name: str):
    def register(fn):
        CHECKS.append((name, fn))
        return fn
    return register



@check("config.present")
def check_config_present(ctx: Context) -> Check:
    ok = ctx.draft_config is not None
    return Check("config.present", ok, "config.json (speculators format)",
                 "present" if ok else ctx.config_error,
                 "" if ok else f"{ctx.draft}: no usable config.json; a speculators checkpoint dir holds "
                               f"config.json + model.safetensors. Was the draft saved with save_pretrained?")


@check("config.speculators_model_type")
def check_model_type(ctx: Context) -> Check:
    seen = ctx.config().get("speculators_model_type")
    ok = seen == "eagle3"
    detail = "" if ok else (
        "no speculators_model_type: this is not a speculators checkpoint (vLLM would load it as a plain model)"
        if seen is None else
        f"this is a {seen!r} speculator; this pipeline builds and verifies EAGLE-3 drafts "
        f"(vLLM method 'eagle3'). Point the draft at an EAGLE-3 checkpoint.")
    return Check("config.speculators_model_type", ok, "eagle3", seen, detail)


@check("config.architectures")
def check_architectures(ctx: Context) -> Check:
    seen = ctx.eagle3_config().get("architectures")
    ok = isinstance(seen, list) and len(seen) == 1 and seen[0] in EAGLE3_ARCHITECTURES
    return Check("config.architectures", ok, sorted(EAGLE3_ARCHITECTURES), seen,
                 "" if ok else "architectures must name speculators' EAGLE-3 model class")


@check("config.speculators_version")
def check_version(ctx: Context) -> Check:
    seen = ctx.eagle3_config().get("speculators_version")
    try:
        installed = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    ok = isinstance(seen, str) and bool(seen)
    detail = "" if ok else "speculators_version missing: the checkpoint was not written by speculators"
    if ok and installed and seen.split(".")[:2] != installed.split(".")[:2]:
        detail = f"written by speculators {seen}, installed {installed} (format may differ)"
    return Check("config.speculators_version", ok, f"a version string (installed: {installed})", seen, detail)


@check("config.proposal_methods")
def check_proposal(ctx: Context) -> Check:
    spec = ctx.eagle3_config().get("speculators_config") or {}
    methods = spec.get("proposal_methods")
    seen = methods[0].get("speculative_tokens") if isinstance(methods, list) and methods and isinstance(methods[0], dict) else None
    ok = isinstance(seen, int) and seen >= 1
    return Check("config.proposal_methods", ok, "speculators_config.proposal_methods[0].speculative_tokens >= 1",
                 seen, "" if ok else "vLLM reads the number of speculative tokens from proposal_methods[0]; "
                                     "it is missing or invalid")


def _verifier(ctx: Context) -> dict:
    return (ctx.eagle3_config().get("speculators_config") or {}).get("verifier") or {}


@check("config.verifier_path")
def check_verifier_path(ctx: Context) -> Check:
    name = _verifier(ctx).get("name_or_path")
    expected = os.path.relpath(ctx.target.resolve(), ctx.draft.resolve())
    if not isinstance(name, str) or not name:
        return Check("config.verifier_path", False, expected, name,
                     "speculators_config.verifier.name_or_path missing (vLLM's loader requires it)")
    if os.path.isabs(name):
        return Check("config.verifier_path", False, expected, name,
                     "absolute verifier path: it breaks when results/ moves; train_draft must store the "
                     "path relative to the draft dir (docs/artifacts.md)")
    resolved = (ctx.draft / name).resolve()
    ok = resolved.exists() and os.path.samefile(resolved, ctx.target)
    return Check("config.verifier_path", ok, expected, name,
                 "" if ok else f"resolves to {resolved}, which is not the target {ctx.target}")


@check("config.verifier_architectures")
def check_verifier_architectures(ctx: Context) -> Check:
    seen = _verifier(ctx).get("architectures")
    expected = ctx.target_config.get("architectures")
    ok = seen == expected
    return Check("config.verifier_architectures", ok, expected, seen,
                 "" if ok else "the draft was trained for another verifier architecture")


@check("config.transformer_layer_config")
def check_layer_config(ctx: Context) -> Check:
    tl = ctx.layer_config()
    tc = ctx.tc
    heads = tc.get("num_attention_heads")
    expected = {"model_type": sorted(VLLM_EAGLE3_LAYER_TYPES), "hidden_size": tc.get("hidden_size"),
                "vocab_size": tc.get("vocab_size"), "num_attention_heads": heads,
                "num_key_value_heads": tc.get("num_key_value_heads", heads)}
    seen = {"model_type": tl.get("model_type"), "hidden_size": tl.get("hidden_size"),
            "vocab_size": tl.get("vocab_size"), "num_attention_heads": tl.get("num_attention_heads"),
            "num_key_value_heads": tl.get("num_key_value_heads", tl.get("num_attention_heads"))}
    problems = []
    if seen["model_type"] not in VLLM_EAGLE3_LAYER_TYPES:
        problems.append(f"model_type {seen['model_type']!r} has no vLLM EAGLE-3 model "
                        f"(supported: {sorted(VLLM_EAGLE3_LAYER_TYPES)})")
    target_hidden = ctx.eagle3_config().get("target_hidden_size") or seen["hidden_size"]
    if target_hidden != expected["hidden_size"]:
        problems.append(f"target hidden size {target_hidden} != the target's {expected['hidden_size']}")
    if seen["hidden_size"] != expected["hidden_size"]:
        problems.append(f"hidden_size {seen['hidden_size']} != the target's {expected['hidden_size']} "
                        f"(the draft shares the target's embeddings)")
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads"):
        if seen[key] != expected[key]:
            problems.append(f"{key} {seen[key]} != the target's {expected[key]}")
    return Check("config.transformer_layer_config", not problems, expected, seen, "; ".join(problems))


@check("config.draft_vocab_size")
def check_draft_vocab(ctx: Context) -> Check:
    seen = ctx.eagle3_config().get("draft_vocab_size")
    vocab = ctx.tc.get("vocab_size")
    ok = isinstance(seen, int) and 1 <= seen <= (vocab or 0)
    return Check("config.draft_vocab_size", ok, f"1..{vocab} (target vocab)", seen,
                 "" if ok else "draft_vocab_size missing or larger than the target's vocabulary")


@check("aux_layer_ids.present")
def check_aux_present(ctx: Context) -> Check:
    ids = ctx.eagle3_config().get("eagle_aux_hidden_state_layer_ids")
    n = num_layers(ctx.target_config)
    ok = (isinstance(ids, list) and len(ids) > 0 and all(isinstance(i, int) for i in ids)
          and len(set(ids)) == len(ids) and all(0 <= i <= n for i in ids))
    detail = "" if ok else (
        "eagle_aux_hidden_state_layer_ids missing: vLLM silently falls back to default layers and "
        "acceptance collapses" if ids is None else f"layer ids must be distinct integers in 0..{n}")
    return Check("aux_layer_ids.present", ok, f"distinct layer ids in 0..{n}", ids, detail)


@check("aux_layer_ids.match_hidden_states")
def check_aux_match(ctx: Context) -> Check:
    ids = ctx.eagle3_config().get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        raise NotRun("no eagle_aux_hidden_state_layer_ids (see aux_layer_ids.present)")
    expected = ctx.hs_manifest.get("aux_layer_ids")
    ok = ids == expected
    detail = "" if ok else ("the draft reads other target layers than its training hidden states came from "
                            "(hidden_states/manifest.json); retrain, or fix the layer ids the draft was saved with")
    server = ctx.hs_manifest.get("server_layer_ids")
    if ok and server is not None and server != [*ids, ctx.hs_manifest.get("final_layer_id")]:
        # Online training: the server must have extracted exactly these aux layers, then the final one.
        ok, detail = False, (f"the online training server extracted layers {server}, not the draft's aux ids "
                             f"+ the final layer; retrain")
    return Check("aux_layer_ids.match_hidden_states", ok, expected, ids, detail)


@check("hidden_states.target_digest")
def check_hs_target(ctx: Context) -> Check:
    expected = ctx.target_manifest.get("weights_digest")
    seen = ctx.hs_manifest.get("target_digest")
    ok = expected is not None and seen == expected
    return Check("hidden_states.target_digest", ok, expected, seen,
                 "" if ok else "the training hidden states were extracted from another target (or its digest "
                               "is missing); rerun hidden-state extraction")


@check("hidden_states.read_as_stored")
def check_read_as_stored(ctx: Context) -> Check:
    """Training read the hidden states through speculators' transfer for their storage format:
    fp8 files read as plain files would train on unscaled fp8 values without any error."""
    from pipeline_lib.hidden_states.formats import FORMATS

    if ctx.hs_record is None:
        raise NotRun("no training hidden-states record (--hs-record, drafts/<variant>/hidden_states.json)")
    storage = ctx.hs_manifest.get("storage", "bf16")
    seen = {k: (ctx.hs_record or {}).get(k) for k in ("mode", "storage", "transfer")}
    expected = {"storage": storage, "transfer": FORMATS[storage].transfer_backend if storage in FORMATS else None}
    ok = expected["transfer"] is not None and all(seen[k] == v for k, v in expected.items())
    return Check("hidden_states.read_as_stored", ok, expected, seen,
                 "" if ok else "the trainer read the hidden states through another transfer than their storage "
                               "format needs (hidden_states.json vs the hidden-states manifest); retrain")


def expected_shapes(ctx: Context) -> tuple[dict[str, list[int]], set[str]]:
    """(required name -> shape, optional names) for an EAGLE-3 checkpoint, from its own config."""
    cfg, tl = ctx.eagle3_config(), ctx.layer_config()
    H = tl["hidden_size"]
    heads = tl["num_attention_heads"]
    kv = tl.get("num_key_value_heads") or heads
    hd = tl.get("head_dim") or H // heads
    inter = tl["intermediate_size"]
    V = tl["vocab_size"]
    dvs = cfg.get("draft_vocab_size") or V
    n_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    th = cfg.get("target_hidden_size") or H
    shapes = {"fc.weight": [H, n_aux * th], "lm_head.weight": [dvs, H], "norm.weight": [H],
              "embed_tokens.weight": [V, H]}
    optional = {"embed_tokens.weight"}  # vLLM shares the target's when absent
    if dvs != V:
        shapes.update({"d2t": [dvs], "t2d": [V]})
    if cfg.get("norm_before_fc"):
        shapes["input_norm.weight"] = [n_aux * th]
    if cfg.get("fc_norm"):
        shapes.update({f"fc_norm.{j}.weight": [th] for j in range(n_aux)})
    for i in range(tl.get("num_hidden_layers", 1)):
        p = f"layers.{i}."
        width = 2 * H if i == 0 else H
        shapes.update({
            p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
            p + "self_attn.q_proj.weight": [heads * hd, width], p + "self_attn.k_proj.weight": [kv * hd, width],
            p + "self_attn.v_proj.weight": [kv * hd, width], p + "self_attn.o_proj.weight": [H, heads * hd],
            p + "mlp.gate_proj.weight": [inter, H], p + "mlp.up_proj.weight": [inter, H],
            p + "mlp.down_proj.weight": [H, inter]})
        if i == 0:
            shapes[p + "hidden_norm.weight"] = [H]
        if tl.get("attention_bias"):
            shapes.update({p + "self_attn.q_proj.bias": [heads * hd], p + "self_attn.k_proj.bias": [kv * hd],
                           p + "self_attn.v_proj.bias": [kv * hd]})
        if tl.get("model_type") == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
    return shapes, optional


@check("weights.readable")
def check_weights_readable(ctx: Context) -> Check:
    try:
        w = ctx.weights()
    except NotRun as err:
        return Check("weights.readable", False, "*.safetensors in the draft dir", None, str(err))
    return Check("weights.readable", True, "*.safetensors in the draft dir",
                 {"files": [f.name for f in w.files], "tensors": len(w.shapes)})


@check("weights.shapes")
def check_weight_shapes(ctx: Context) -> Check:
    w = ctx.weights()
    shapes, optional = expected_shapes(ctx)
    missing = sorted(n for n in shapes if n not in w.shapes and n not in optional)
    wrong = {n: {"expected": s, "seen": w.shapes[n]} for n, s in shapes.items() if n in w.shapes and w.shapes[n] != s}
    unexpected = sorted(n for n in w.shapes if n not in shapes)
    problems = []
    if missing:
        problems.append(f"missing: {missing}")
    if wrong:
        problems.append("wrong shape: " + ", ".join(f"{n} {v['seen']} (expected {v['expected']})" for n, v in wrong.items()))
    if unexpected:
        problems.append(f"unexpected (vLLM's loader rejects unknown weights): {unexpected}")
    return Check("weights.shapes", not problems, {"tensors": len(shapes), "from": "draft config + target sizes"},
                 {"missing": missing, "wrong_shape": wrong, "unexpected": unexpected}, "; ".join(problems))


@check("weights.finite")
def check_finite(ctx: Context) -> Check:
    import torch

    w = ctx.weights()
    bad = {}
    for name in sorted(w.shapes):
        t = w.tensor(name)
        if t.is_floating_point():
            n_bad = int((~torch.isfinite(t)).sum())
            if n_bad:
                bad[name] = n_bad
    return Check("weights.finite", not bad, "no NaN/Inf in any tensor", bad or "all finite",
                 "" if not bad else "non-finite values (count per tensor); the checkpoint is corrupt or training diverged")


@check("vocab_maps")
def check_vocab_maps(ctx: Context) -> Check:
    import torch

    cfg, tl = ctx.eagle3_config(), ctx.layer_config()
    w = ctx.weights()
    V, dvs = tl.get("vocab_size"), cfg.get("draft_vocab_size")
    if dvs == V and "d2t" not in w.shapes:
        return Check("vocab_maps", True, "no d2t/t2d (draft vocab = target vocab)", "none", "full vocabulary")
    if "d2t" not in w.shapes or "t2d" not in w.shapes:
        return Check("vocab_maps", False, "d2t and t2d tensors", sorted(n for n in ("d2t", "t2d") if n in w.shapes),
                     f"draft_vocab_size {dvs} < vocab {V} needs d2t/t2d; without them vLLM maps draft ids to the "
                     f"first {dvs} target ids (silently wrong)")
    d2t, t2d = w.tensor("d2t").long(), w.tensor("t2d").bool()
    mapped = torch.arange(d2t.shape[0]) + d2t
    problems = []
    if list(d2t.shape) != [dvs]:
        problems.append(f"d2t has {d2t.shape[0]} entries, draft_vocab_size is {dvs}")
    if list(t2d.shape) != [V]:
        problems.append(f"t2d has {t2d.shape[0]} entries, target vocab is {V}")
    if int(t2d.sum()) != dvs:
        problems.append(f"t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {dvs}")
    outside = ((mapped < 0) | (mapped >= V)).nonzero().flatten().tolist()
    if outside:
        problems.append(f"{len(outside)} draft ids map outside the target vocab [0, {V}) "
                        f"(e.g. draft id {outside[0]} -> {int(mapped[outside[0]])})")
    if len(set(mapped.tolist())) != len(mapped):
        problems.append("d2t maps two draft ids to the same target id")
    if not problems and not bool(t2d[mapped].all()):
        problems.append("d2t and t2d disagree (a mapped target id is not marked in t2d)")
    seen = {"d2t": list(d2t.shape), "t2d": list(t2d.shape), "t2d_true": int(t2d.sum()),
            "mapped_min": int(mapped.min()), "mapped_max": int(mapped.max())}
    return Check("vocab_maps", not problems, {"d2t": [dvs], "t2d": [V], "t2d_true": dvs,
                                              "mapped_range": [0, V - 1]}, seen, "; ".join(problems))


def target_embeddings(target: Path):
    """The target's input embedding matrix (plain or nested multimodal layout)."""
    from safetensors import safe_open

    index = target / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {n: target / f for n, f in weight_map.items()}
    else:
        where = {}
        for f in safetensors_files(target):
            with safe_open(str(f), framework="pt") as st:
                where.update({n: f for n in st.keys()})
    name = next((n for n in EMBED_NAMES if n in where), None)
    if name is None:
        name = next((n for n in where if n.endswith("embed_tokens.weight")), None)
    if name is None:
        raise NotRun(f"{target}: no embed_tokens weight found among the target's tensors")
    with safe_open(str(where[name]), framework="pt") as st:
        return name, st.get_tensor(name)


@check("embeddings.match_target")
def check_embeddings(ctx: Context) -> Check:
    import torch

    w = ctx.weights()
    if "embed_tokens.weight" not in w.shapes:
        return Check("embeddings.match_target", True, "the target's embed_tokens", "absent",
                     "the draft has no embed_tokens; vLLM shares the target's")
    name, ref = target_embeddings(ctx.target)
    emb = w.tensor("embed_tokens.weight")
    if list(emb.shape) != list(ref.shape):
        return Check("embeddings.match_target", False, list(ref.shape), list(emb.shape),
                     f"shape differs from the target's {name}")
    # Compare at the lower precision of the two: a bf16 copy of fp32 weights is still "equal".
    low = min((emb.dtype, ref.dtype), key=lambda d: torch.finfo(d).bits)
    a, b = emb.to(low), ref.to(low)
    equal_rows = (a == b).all(dim=1)
    diff = float((emb.float() - ref.float()).abs().max())
    ok = bool(equal_rows.all())
    seen = {"rows_equal": int(equal_rows.sum()), "rows": int(emb.shape[0]), "max_abs_diff": diff}
    return Check("embeddings.match_target", ok, f"equal to target {name}", seen,
                 "" if ok else "the draft's embeddings are not the target's (random or from another model): "
                               "a known silent failure, acceptance collapses; load them from the verifier")


def _digest_check(key: str) -> None:
    name = f"training_data.{key}"

    @check(name)
    def compare(ctx: Context) -> Check:
        expected, seen = ctx.target_manifest.get(key), ctx.stats.get(key)
        ok = expected is not None and seen == expected
        return Check(name, ok, expected, seen,
                     "" if ok else f"tokenized/stats.json {key} differs from target/manifest.json (or is missing): "
                                   f"the draft was trained on data tokenized for another tokenizer/template")


_digest_check("tokenizer_digest")
_digest_check("chat_template_digest")


# ---------------------------------------------------------------------------------------------
# Train vs serve: the prompt tokens the draft trained on are the ones the serving engine feeds


SERVING_RENDER = "training_data.matches_serving_render"
SERVING_RENDER_ROWS = 8   # default of verify.serve_render_rows


class ServingRenderer:
    """vLLM's own chat rendering of the target, built as vLLM's GPU-less render server builds
    it (entrypoints/launchers/render: model config -> VllmConfig -> renderer_from_config, no
    engine) and called as LLM.chat / enqueue_chat call it (LLM._preprocess_chat): vLLM's
    resolved chat template, its tokenizer loading, add_generation_prompt, no special tokens
    added by the tokenizer."""

    def __init__(self, target: Path, settings: dict):
        # ImportError here means "vLLM is not installed": the caller reports the check as not run.
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import ChatParams, merge_kwargs, renderer_from_config
        from vllm.utils.mistral import is_mistral_tokenizer

        model_config = EngineArgs(model=str(target),
                                  trust_remote_code=bool(settings.get("trust_remote_code"))).create_model_config()
        model_config.quantization = None  # rendering only: no kernels to validate
        self.renderer = renderer_from_config(VllmConfig(model_config=model_config))
        self.chat_params = ChatParams(chat_template_kwargs=merge_kwargs(
            settings.get("chat_template_kwargs") or {},
            dict(add_generation_prompt=True, continue_final_message=False, tools=None,
                 tokenize=is_mistral_tokenizer(self.renderer.tokenizer) or model_config.enable_prompt_embeds)))
        self.tok_params = self.renderer.default_chat_tok_params.with_kwargs(add_special_tokens=False)

    def ids(self, messages: list[dict]) -> list[int]:
        _, (engine_input,) = self.renderer.render_chat([messages], self.chat_params, self.tok_params)
        return list(engine_input["prompt_token_ids"])

    def text(self, ids: list[int]) -> str:
        return self.renderer.tokenizer.decode(ids)


def turn_requests(row: dict) -> list[list[dict]]:
    """The messages each answered user turn of a trace row sent to the target, in order (the
    traces stage's own context rule, pipeline_lib.traces.turn_messages); a failed turn ends it."""
    from pipeline_lib.traces import row_turns, turn_messages

    later_users = [t["user"] for t in row.get("later_turns") or []]
    requests, earlier = [], []
    for k, turn in enumerate(row_turns(row)):
        if turn.get("finish_reason") == "error":
            break
        requests.append(turn_messages(row["messages"], earlier, later_users[:k]))
        earlier.append((turn.get("answer"), turn.get("reasoning") or None))
    return requests


def answer_starts(loss_mask: list[int]) -> list[int]:
    """Where each trained answer starts: the first token of every run of loss-masked tokens."""
    return [i for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1])]


def sample_indices(n: int, k: int | None) -> list[int]:
    """k row indices evenly spaced over n rows (all when k is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_row(serving: ServingRenderer, row_id: str, ids: list[int], mask: list[int],
                requests: list[list[dict]]) -> tuple[int, list[dict]]:
    """(turns compared, mismatches) of one training row. Each answer's prompt part (the row's
    tokens before it) must equal vLLM's render of one turn's request, turns in order. A row
    that continues a conversation (`<id>#2`) starts at a later turn, and a turn whose answer
    has no token in the loss has no run, so each answer is matched to the first of the
    remaining turns whose render equals it; when none does, the mismatch is reported against
    the turn whose render agrees longest."""
    compared, mismatches, next_turn = 0, [], 0
    renders: dict[int, list[int]] = {}
    for start in answer_starts(mask):
        prompt = ids[:start]
        candidates = range(next_turn, len(requests))
        for k in candidates:
            renders.setdefault(k, serving.ids(requests[k]))
            if renders[k] == prompt:
                compared, next_turn = compared + 1, k + 1
                break
        else:
            compared += 1
            if not candidates:
                mismatches.append({"row": row_id, "turn": None, "answer_at": start,
                                   "problem": f"more answers in the row than the trace has turns ({len(requests)})"})
                break
            k = max(candidates, key=lambda j: first_difference(renders[j], prompt))
            at = first_difference(renders[k], prompt)
            mismatches.append({
                "row": row_id, "turn": k + 1, "answer_at": start, "first_difference": at,
                "training_tokens": len(prompt), "serving_tokens": len(renders[k]),
                "training": serving.text(prompt[at:at + 12]), "serving": serving.text(renders[k][at:at + 12])})
            break  # later answers of this row follow a prompt that already differs
    return compared, mismatches


@check(SERVING_RENDER)
def check_serving_render(ctx: Context) -> Check:
    """A sample of tokenized rows: every answer's prompt part equals, token for token, what
    vLLM's own chat rendering makes of the same request (reasoning and end-of-turn tokens of
    earlier answers included). The digests say the template file is the same; this says the
    engine that serves the target feeds the draft the context it was trained after."""
    import datasets

    if ctx.tokenized_data is None or ctx.traces is None:
        raise NotRun("no tokenized data or traces given (--tokenized-data, --traces)")
    want = ctx.settings.get("serve_render_rows", SERVING_RENDER_ROWS)
    if want is not None and (not isinstance(want, int) or isinstance(want, bool) or want < 1):
        raise PipelineError(f"setting verify.serve_render_rows = {want!r}: give an integer >= 1 (rows compared) "
                            f"or null (all rows)")
    expected = ("each sampled training row's prompt ids before every answer = vLLM's chat render of that "
                "turn's request, token for token")
    try:
        serving = ServingRenderer(ctx.target, ctx.settings)
    except ImportError as err:
        return Check(SERVING_RENDER, None, expected, None,
                     f"not run: vLLM is not importable here ({err}), so the serving engine's own chat rendering "
                     f"cannot be compared with the training rows; run the contract checks where vLLM is "
                     f"installed (the serving stack) to prove it", required=False)
    except Exception as err:  # vLLM refuses the target's config or tokenizer: it could not serve it either
        return Check(SERVING_RENDER, False, expected, None,
                     f"vLLM cannot build its chat renderer for {ctx.target} ({type(err).__name__}: "
                     f"{' '.join(str(err).split())[:400]}), so it could not serve this target as it is")
    row_ids = ctx.stats.get("row_ids")
    datasets.disable_progress_bars()
    data = datasets.load_from_disk(str(ctx.tokenized_data)).with_format(None)
    if not isinstance(row_ids, list) or len(row_ids) != len(data):
        raise NotRun(f"tokenized/stats.json row_ids ({len(row_ids) if isinstance(row_ids, list) else 'missing'}) "
                     f"do not name the {len(data)} rows of {ctx.tokenized_data}; rerun the tokenize stage")
    picked = sample_indices(len(data), want)
    trace_ids = {row_ids[i].split("#")[0] for i in picked}
    traces = {}
    for _, row in read_jsonl(ctx.traces):
        if str(row.get("id")) in trace_ids:
            traces[str(row["id"])] = row
    compared, mismatches, multi_turn = 0, [], 0
    for i in picked:
        trace_id = row_ids[i].split("#")[0]
        if trace_id not in traces:
            raise PipelineError(f"{ctx.traces}: no trace row {trace_id!r}, which tokenized row {i} ({row_ids[i]}) "
                                f"came from; the traces and the tokenized data are of different runs")
        requests = turn_requests(traces[trace_id])
        multi_turn += len(requests) > 1
        n, bad = compare_row(serving, row_ids[i], data[i]["input_ids"], data[i]["loss_mask"], requests)
        compared += n
        mismatches += bad
    seen = {"rows": len(picked), "of_rows": len(data), "answers_compared": compared,
            "multi_turn_rows": multi_turn, "rows_differing": len(mismatches), "mismatches": mismatches[:5]}
    if not mismatches:
        return Check(SERVING_RENDER, True, expected, seen)
    m = mismatches[0]
    where = (f"row {m['row']} turn {m['turn']}: token {m['first_difference']} is {m['training']!r} in training, "
             f"{m['serving']!r} as vLLM renders it" if m["turn"] else f"row {m['row']}: {m['problem']}")
    return Check(SERVING_RENDER, False, expected, seen,
                 f"{len(mismatches)} of {len(picked)} sampled rows were trained after prompt tokens the serving engine "
                 f"does not produce ({where}); the draft learned a context it never sees when served. Retokenize "
                 f"with the template and chat_template_kwargs vLLM serves the target with (rerun tokenize)")


def run_check(name: str, fn: Callable[[Context], Check], ctx: Context) -> Check:
    try:
        result = fn(ctx)
        result.name = name
        return result
    except NotRun as why:
        return Check(name, None, None, None, f"not run: {why}")
    except PipelineError:  # a pipeline input (not the draft) is unusable: exit 2 naming it
        raise
    except Exception as err:  # a malformed field must not hide the other checks
        return Check(name, False, None, None, f"check crashed on this draft: {type(err).__name__}: {err}")


# ---------------------------------------------------------------------------------------------
# Optional side-by-side comparison with a reference draft (e.g. a published one)

REFERENCE_FIELDS = ["speculators_model_type", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                    "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                    "transformer_layer_config.model_type", "transformer_layer_config.hidden_size",
                    "transformer_layer_config.num_hidden_layers", "transformer_layer_config.num_attention_heads",
                    "transformer_layer_config.num_key_value_heads", "transformer_layer_config.intermediate_size",
                    "transformer_layer_config.vocab_size",
                    "speculators_config.proposal_methods.0.speculative_tokens",
                    "speculators_config.verifier.architectures"]


def _field(cfg: dict | None, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
    return value


def compare_reference(ctx: Context, ref_setting: str) -> tuple[list[Check], dict]:
    try:
        ref_dir = Path(resolve_asset(ref_setting))
    except FileNotFoundError as err:
        ref_dir = Path(ref_setting)
        why = str(err)
    else:
        why = f"{ref_dir}/config.json not found"
    if not (ref_dir / "config.json").exists():
        msg = f"settings verify.reference_draft = {ref_setting!r}: {why}; give a speculators checkpoint dir"
        return [Check("reference_draft.config", False, "a checkpoint dir", ref_setting, msg, required=False)], \
            {"path": ref_setting, "error": msg}
    ref_cfg = read_json(ref_dir / "config.json", "reference draft config")
    rows = [{"field": f, "draft": _field(ctx.draft_config, f), "reference": _field(ref_cfg, f)} for f in REFERENCE_FIELDS]
    for r in rows:
        r["same"] = r["draft"] == r["reference"]
    differing = [r["field"] for r in rows if not r["same"]]
    checks = [Check("reference_draft.config", not differing, "same config fields as the reference",
                    {"differing": differing}, "differences are listed in contract.json reference.fields; "
                    "informational" if differing else "", required=False)]
    report: dict[str, Any] = {"path": str(ref_dir), "fields": rows}
    try:
        ours, theirs = ctx.weights().shapes, Weights(ref_dir).shapes
        weights = {"only_in_draft": sorted(set(ours) - set(theirs)), "only_in_reference": sorted(set(theirs) - set(ours)),
                   "shape_differs": {n: {"draft": ours[n], "reference": theirs[n]}
                                     for n in sorted(set(ours) & set(theirs)) if ours[n] != theirs[n]}}
        same = not any(weights.values())
        checks.append(Check("reference_draft.weights", same, "same weight names and shapes as the reference",
                            weights, "" if same else "layouts differ (informational)", required=False))
        report["weights"] = weights
    except Exception as err:
        checks.append(Check("reference_draft.weights", None, None, None, f"not run: {err}", required=False))
    return checks, report


# ---------------------------------------------------------------------------------------------


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, help="target model dir (R/target/model)")
    p.add_argument("--target-manifest", required=True, help="R/target/manifest.json")
    p.add_argument("--draft", required=True, help="draft checkpoint dir (R/drafts/<variant>/final)")
    p.add_argument("--hs-manifest", required=True, help="R/hidden_states/manifest.json")
    p.add_argument("--tokenized-stats", required=True, help="R/tokenized/stats.json")
    p.add_argument("--hs-record", required=True,
                   help="R/drafts/<variant>/hidden_states.json (what training read, and how)")
    p.add_argument("--tokenized-data", required=True, help="R/tokenized/data (the rows the draft trained on)")
    p.add_argument("--traces", required=True, help="R/traces/traces.jsonl (the conversations those rows came from)")
    p.add_argument("--out", required=True, help="contract.json to write")
    args = p.parse_args()
    runtime.setup()
    prov = Provenance("contract_checks", args.settings)

    target = Path(args.target)
    ctx = Context(draft=Path(args.draft), target=target, target_config=load_config(target),
                  target_manifest=load_manifest(args.target_manifest),
                  hs_manifest=read_json(args.hs_manifest, "hidden-states manifest"),
                  stats=read_json(args.tokenized_stats, "tokenized stats"), settings=args.settings,
                  hs_record=read_json(args.hs_record, "training hidden-states record"),
                  tokenized_data=Path(args.tokenized_data), traces=Path(args.traces))
    for what, path in (("tokenized data", ctx.tokenized_data), ("traces", ctx.traces)):
        if not path.exists():
            raise PipelineError(f"{path}: {what} not found; run the tokenize stage (and the traces stage) first")
    if not ctx.draft.is_dir():
        raise PipelineError(f"{ctx.draft}: draft dir not found; run the train_draft rule first")
    load_draft_config(ctx)

    checks = [run_check(name, fn, ctx) for name, fn in CHECKS]
    reference = None
    if args.settings.get("reference_draft"):
        ref_checks, reference = compare_reference(ctx, args.settings["reference_draft"])
        checks += ref_checks
    required = [c for c in checks if c.required]
    passed = all(c.passed is True for c in required)
    summary = {"passed": sum(c.passed is True for c in checks), "failed": sum(c.passed is False for c in checks),
               "not_run": sum(c.passed is None for c in checks),
               "failed_required": [c.name for c in required if c.passed is False]}
    record = {"passed": passed, "summary": summary, "checks": [asdict(c) for c in checks],
              "draft": str(args.draft), "target": str(args.target), "reference": reference}
    # Details quote settings and paths as given (a reference_draft URL, say): no credential in them.
    record = scrub_obj(record)
    atomic_write_json(args.out, record)
    prov.write(Path(args.out).with_name(Path(args.out).stem + ".provenance.json"),
               inputs={"target": args.target, "target_manifest": args.target_manifest, "draft": args.draft,
                       "hs_manifest": args.hs_manifest, "tokenized_stats": args.tokenized_stats,
                       "hs_record": args.hs_record, "tokenized_data": args.tokenized_data, "traces": args.traces},
               outputs={"contract": args.out})
    for c in record["checks"]:
        mark = {True: "PASS", False: "FAIL", None: "----"}[c["passed"]]
        print(f"[contract] {mark} {c['name']}{'' if c['required'] else ' (informational)'}"
              f"{': ' + c['detail'] if c['detail'] and c['passed'] is not True else ''}", file=sys.stderr)
    print(f"[contract] {'PASSED' if passed else 'FAILED'}: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
