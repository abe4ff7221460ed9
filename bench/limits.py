#!/usr/bin/env python
"""What the hardware allows, measured on the rows a finished benchmark run used; one JSON each.

    python bench/limits.py traces        --run R --out traces.json
    python bench/limits.py hidden-states --run R --config C.yaml [--config overlay.yaml] --out hs.json
    python bench/limits.py train         --run R --out train.json [--variant default]

traces         transformers' own `generate` at the run's batch size and mean prompt length, every
               row decoding the full max_tokens (no padding, no early stop, no prompt rendering,
               no trace rows): the backend's decoding without the pipeline around it. Timed on
               its second call (the first one loads kernels).
hidden-states  (b) forward: the backend's own hooked decoder forward over the run's tokenized
               rows in the backend's own batches, no stack, no copy, no write;
               (a) disk: fsync'd sequential writes (one writer, one file after the other) of files
               the sizes of the run's hidden-state files into the run's results filesystem.
train          speculators' own entry point (`python -m speculators.train`, argv exactly as the
               rule passed it, its own save and log dirs), timed the same way as the rule's run:
               from speculators' run.yaml (written as its main starts) to each epoch's
               training_state.json (written last when an epoch is saved).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "scripts"))


def device() -> str:
    from pipeline_lib.runtime import has_cuda

    return "cuda" if has_cuda() else "cpu"


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def facts() -> dict:
    import torch
    import transformers

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}


# --------------------------------------------------------------------------------- traces

def traces_limit(run: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline_lib.runtime import padded_batch_attention

    (summary_path,) = sorted((run / "traces" / "shards").glob("*.summary.json"))[:1]
    shard = json.loads(summary_path.read_text())
    settings = shard["settings"]
    batch, max_new = settings["batch_size"], settings["max_tokens"]
    prompt_len = max(1, round(shard["prompt_tokens"] / max(1, shard["rows"])))
    manifest = json.loads((run / "target" / "manifest.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(run / "target" / "model", dtype=getattr(torch, manifest["dtype"]))
    model = model.to(device()).eval()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(10, min(vocab, 8000), (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    padded_batch_attention()  # as the backend decodes
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    times = []
    for _ in range(2):  # the first call loads kernels
        sync()
        t0 = time.monotonic()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, **kwargs)
        sync()
        times.append(time.monotonic() - t0)
    tokens = batch * (out.shape[1] - prompt_len)
    return {"what": "transformers generate, same batch/mean prompt, full max_tokens, second call",
            "batch_size": batch, "prompt_tokens": prompt_len, "max_new_tokens": max_new,
            "first_call_s": round(times[0], 3), "s": round(times[1], 3), "tokens": tokens,
            "tokens_per_s": round(tokens / times[1], 1), **facts()}


# -------------------------------------------------------------------------- hidden states

def load_config(paths: list[str]) -> dict:
    """The run's config as Snakemake merges --configfile A B (later files override)."""
    import yaml

    def merge(base: dict, over: dict) -> dict:
        for k, v in over.items():
            base[k] = merge(dict(base.get(k) or {}), v) if isinstance(v, dict) else v
        return base

    config: dict = {}
    for p in paths:
        config = merge(config, yaml.safe_load(Path(p).read_text()) or {})
    return config


def rows_of(run: Path):
    import datasets

    from pipeline_lib.hidden_states import Row

    ds = datasets.load_from_disk(str(run / "tokenized" / "data")).with_format(None)
    return [Row(i, list(ids)) for i, ids in enumerate(ds["input_ids"])]


def forward_limit(run: Path, settings: dict) -> dict:
    from pipeline_lib.hidden_states import BACKENDS, layer_spec

    rows = rows_of(run)
    target = run / "target" / "model"
    spec = layer_spec(target, settings)
    backend = BACKENDS["transformers"](target, spec, settings, max(len(r.input_ids) for r in rows))
    batches = backend.plan(rows)
    backend.forward(batches[-1])  # warm-up: kernels, allocator
    sync()
    t0 = time.monotonic()
    for batch in batches:
        backend.forward(batch)
    sync()
    forward_s = time.monotonic() - t0
    # For the profile: the same forward plus the stack and a plain (pageable) copy to the host.
    t0 = time.monotonic()
    for batch in batches:
        backend.capture(batch).to("cpu")
    copy_s = time.monotonic() - t0
    tokens = sum(len(r.input_ids) for r in rows)
    return {"what": "hooked decoder forward, the backend's batches, no stack/copy/write",
            "rows": len(rows), "tokens": tokens, "batches": len(batches), "s": round(forward_s, 3),
            "tokens_per_s": round(tokens / forward_s, 1),
            "with_stack_and_pageable_copy_tokens_per_s": round(tokens / copy_s, 1)}


def disk_limit(run: Path) -> dict:
    shards = [json.loads(p.read_text()) for p in sorted((run / "hidden_states" / "shards").glob("*.json"))]
    sizes = [size for shard in shards for size in shard["file_bytes"].values()]
    tokens = sum(shard["tokens"] for shard in shards)
    block = os.urandom(max(sizes))  # incompressible
    view = memoryview(block)
    out = Path(tempfile.mkdtemp(prefix=".disk-limit-", dir=run))
    try:
        t0 = time.monotonic()
        for i, size in enumerate(sizes):
            with open(out / f"f{i}", "wb") as f:
                f.write(view[:size])
                f.flush()
                os.fsync(f.fileno())
        s = time.monotonic() - t0
    finally:
        shutil.rmtree(out)
    total = sum(sizes)
    return {"what": "fsync'd sequential writes of the run's hidden-state file sizes, one writer",
            "files": len(sizes), "bytes": total, "s": round(s, 3), "GB_per_s": round(total / s / 1e9, 3),
            "tokens": tokens, "tokens_per_s": round(tokens / s, 1), "filesystem_of": str(run)}


def hidden_states_limits(run: Path, config: dict) -> dict:
    settings = {**config.get("hidden_states", {}), "trust_remote_code": False}
    forward = forward_limit(run, settings)
    disk = disk_limit(run)
    return {"forward": forward, "disk": disk, **facts()}


# --------------------------------------------------------------------------------- train

def epoch_times(save_dir: Path) -> dict:
    """Seconds from speculators' run.yaml (its main started) to each saved epoch."""
    start = (save_dir / "run.yaml").stat().st_mtime
    ends = {int(d.name): (d / "training_state.json").stat().st_mtime
            for d in save_dir.iterdir() if d.is_dir() and d.name.isdigit() and (d / "training_state.json").exists()}
    marks = [start] + [ends[e] for e in sorted(ends)]
    return {"total_s": round(marks[-1] - start, 3),
            "epoch_s": [round(b - a, 3) for a, b in zip(marks, marks[1:])]}


def train_limit(run: Path, variant: str) -> dict:
    prov = json.loads((run / "drafts" / variant / "provenance.json").read_text())
    argv = list(prov["trainer_argv"])
    work = run / "bench-speculators-alone"
    shutil.rmtree(work, ignore_errors=True)
    argv[argv.index("--save-path") + 1] = str((work / "checkpoints").resolve())
    argv[argv.index("--log-dir") + 1] = str((work / "logs").resolve())
    # Cold compile caches, as the rule's own run had: a warm inductor cache would flatter it.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton")}
    t0 = time.monotonic()
    with open(work.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, str(BENCH / "speculators_alone.py"), *argv], check=True, env=env,
                       stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    alone = epoch_times(work / "checkpoints")
    rule = epoch_times(run / "drafts" / variant / "checkpoints")
    shutil.rmtree(work / "inductor", ignore_errors=True)
    shutil.rmtree(work / "triton", ignore_errors=True)
    return {"what": "python -m speculators.train with the rule's argv (own save/log dirs), cold compile caches",
            "argv": argv, "alone": {**alone, "process_wall_s": round(wall, 3)}, "rule": rule,
            "rule_train_wall_s": prov.get("train_wall_s"), **facts()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["traces", "hidden-states", "train"])
    p.add_argument("--run", required=True, type=Path, help="results/<run_name> of a finished benchmark run")
    p.add_argument("--config", action="append", default=[], help="the run's config files (hidden-states)")
    p.add_argument("--variant", default="default")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    from pipeline_lib import runtime

    runtime.setup()
    if args.what == "traces":
        result = traces_limit(args.run)
    elif args.what == "hidden-states":
        result = hidden_states_limits(args.run, load_config(args.config))
    else:
        result = train_limit(args.run, args.variant)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
