#!/usr/bin/env python
"""Train one draft with speculators' own trainer, of the variant's train.draft_type (EAGLE-3 by
default; pipeline_lib/draft_types.py lists the others).

Reads the hidden-states data dir and its manifest (the aux layer ids come only from there) or,
with `hidden_states.mode: online` (--hs-settings), the tokenized data and a vLLM server this job
starts, asks for each sample's hidden states and stops again (pipeline_lib.hidden_states.training),
builds the draft vocabulary maps (d2t/t2d) with speculators' vocab-mapping code, and runs
`speculators.train.cli.main` in this process (CPU or one GPU), under torchrun (one process per
GPU, or --cpu-processes gloo processes on a machine without GPUs) or under srun + torchrun
(several nodes). Epoch checkpoints go to --checkpoints, which is
not a declared output: a killed run resumes from its latest complete epoch. The parts are in
pipeline_lib/training/ (settings, inputs, checkpoints, trainer, outputs, checkout).

Writes
  --final      the selected epoch (best validation loss or last), verifier path made relative
  --untrained  the same draft and vocab maps before any training step (verification baseline)
  --metrics    CSV, one row per (epoch, split): loss, acc_0..acc_{k-1}, throughput
  --provenance what made them
  --hs-record  the hidden states it trained on: mode, storage, layer ids (and the server's)

    python scripts/train_draft.py --settings '{"epochs": 2, ...}' --target T --target-manifest M \\
        --data D --hs-manifest H --checkpoints C --final F --untrained U --metrics X.csv \\
        --provenance P.json [--gpus 0] [--nodes 1] [--cpu-processes 1] [--hs-record R.json]
    (online: --hs-settings '{"mode": "online", ...}' --data R/tokenized/data
             --token-freq R/tokenized/token_freq.pt, no --hs-manifest)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, dtypes, launch, runtime, speculators_cpu  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.hidden_states.training import training_source  # noqa: E402
from pipeline_lib.io import atomic_write_json, reporting_disk_full, require_free_space  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.training import checkout, log  # noqa: E402
from pipeline_lib.training.checkpoints import (METRICS_LOG, epoch_checkpoint_bytes, prepare_checkpoints,  # noqa: E402
                                               prune, remove_incomplete_epochs, selected_checkpoint,
                                               training_history, trajectory_fingerprint)
from pipeline_lib.training.inputs import check_inputs, write_vocab_maps  # noqa: E402
from pipeline_lib.training.outputs import export_draft, parameter_count, val_summary, write_metrics_csv  # noqa: E402
from pipeline_lib.training.settings import TrainSettings, check_device_settings  # noqa: E402
from pipeline_lib.training.subset import SUBSET_DIR, training_data  # noqa: E402
from pipeline_lib.training.trainer import (UNTRAINED_BUILD, WORKER_SPEC, build_untrained, install_logging,  # noqa: E402
                                           run_worker, train, trainer_argv)


def parse_args():
    p = cli.parser(__doc__)
    p.add_argument("--target", help="target model dir (HF format)")
    p.add_argument("--target-manifest", help="target/manifest.json (its weights_digest)")
    p.add_argument("--data", help="speculators data dir (dataset + hidden_states/ + token_freq.pt)")
    p.add_argument("--hs-manifest", help="hidden_states/manifest.json (aux layer ids, rows, files)")
    p.add_argument("--checkpoints", help="epoch checkpoints + work files (kept across runs: resume)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs in total over all nodes (0: train on CPU)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (> 1: srun + torchrun under SLURM)")
    p.add_argument("--cpu-processes", type=int, default=1,
                   help="with --gpus 0: training processes on this machine's CPU (> 1: torchrun over gloo)")
    p.add_argument("--final", help="output: the selected epoch's draft, vLLM-loadable")
    p.add_argument("--untrained", help="output: the same draft before training")
    p.add_argument("--metrics", help="output: per-(epoch, split) metrics CSV")
    p.add_argument("--provenance", help="output: provenance.json")
    p.add_argument("--hs-settings", type=cli.json_object, default={"mode": "offline"},
                   help="JSON: config.yaml `hidden_states` (mode, storage, and for online mode aux_layer_ids, "
                        "dtype, server_gpus, server_start_timeout_s, request_timeout_s)")
    p.add_argument("--token-freq", help="token_freq.pt for the draft vocabulary (default: DATA/token_freq.pt)")
    p.add_argument("--hs-record", help="output: the hidden states trained on (mode, storage, layer ids)")
    p.add_argument("--tokenized-stats", help="the tokenize stage's stats.json: its row_ids group the rows into "
                                             "conversations (counted in the provenance; train.max_conversations)")
    p.add_argument("--trainer-worker", help=argparse.SUPPRESS)  # set by launch for torchrun processes
    args = p.parse_args()
    if not args.trainer_worker:
        required = ("target", "target_manifest", "data", "checkpoints", "final", "untrained", "metrics",
                    "provenance")
        missing = ["--" + k.replace("_", "-") for k in required if not getattr(args, k)]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def select_device(gpus: int) -> bool:
    """True when training runs on CPU. `gpu: 0` means CPU even on a GPU host."""
    if gpus == 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    runtime.setup()
    on_cpu = not runtime.has_cuda()
    if gpus > 0 and on_cpu:
        raise PipelineError(f"--gpus {gpus} but no CUDA device is visible; set resources.train.gpu: 0 "
                            f"to train on CPU")
    if on_cpu:
        speculators_cpu.check_version()
    return on_cpu


def main() -> int | None:
    args = parse_args()
    if args.trainer_worker:
        return run_worker(args.trainer_worker)

    settings = TrainSettings.from_dict(args.settings)
    source = training_source(args, args.hs_settings)  # offline files or an online vLLM server
    gpus = source.claim_devices(args.gpus)             # online: the server's GPUs are not the trainer's
    mode = launch.select_mode(gpus, args.nodes, args.cpu_processes)
    on_cpu = select_device(gpus)
    check_device_settings(settings, on_cpu)
    prov = Provenance("train_draft", settings.as_dict())
    inputs = check_inputs(args, settings, source)
    if settings.type.full_vocab_only and settings.draft_vocab_size != inputs.target_vocab_size:
        raise PipelineError(f"train.draft_vocab_size = {settings.draft_vocab_size}: speculators trains "
                            f"{settings.type.title} drafts on the target's full vocabulary only; set "
                            f"train.draft_vocab_size: {inputs.target_vocab_size} for this variant")
    log(f"{inputs.rows} rows ({inputs.train_rows} train), {inputs.tokens} tokens, aux layers "
        f"{inputs.aux_layer_ids} from {source.where}; hidden states {source.mode}, storage {source.storage}; "
        f"device {'cpu' if on_cpu else 'cuda'}, launch {mode}")

    ckpt, target = Path(args.checkpoints), Path(args.target)
    # The whole data dir, or a view of a nested subset of its conversations (train.max_conversations).
    used = training_data(Path(args.data), Path(args.token_freq) if args.token_freq else Path(args.data) / "token_freq.pt",
                         Path(args.tokenized_stats) if args.tokenized_stats else None, settings,
                         ckpt / SUBSET_DIR, with_hidden_states=source.mode == "offline")
    trainer_checkout = checkout.checkout_state()
    for stale in checkout.remove_patches(ckpt):  # an earlier speculators run's diff of uncommitted edits
        log(f"removed {stale}")
    resumed_after = prepare_checkpoints(ckpt, trajectory_fingerprint(settings, inputs, source.fingerprint()),
                                        settings.epochs, settings.extend_epochs)
    used = used.materialize()  # after prepare_checkpoints: checkpoints moved aside take their old view along
    data = used.data
    d2t, t2d, vocab_coverage = write_vocab_maps(used.token_freq, settings.draft_vocab_size,
                                                inputs.target_vocab_size, ckpt / "vocab")
    argv = trainer_argv(settings, inputs, target, data, ckpt, d2t, t2d)
    metrics_log = ckpt / METRICS_LOG
    install_logging(metrics_log)

    # The untrained baseline first: cheap, and it proves the flags before hours of training.
    untrained_src = build_untrained(argv, ckpt / UNTRAINED_BUILD, on_cpu)
    plan = launch.plan(launch.LaunchRequest(
        gpus=gpus, nodes=args.nodes, cpu_processes=args.cpu_processes,
        worker=[str(Path(__file__).resolve()), "--trainer-worker", str((ckpt / WORKER_SPEC).resolve())]))
    # Every epoch's checkpoint stays until training ends (keep_last prunes afterwards).
    per_epoch = epoch_checkpoint_bytes(untrained_src)
    remaining = settings.epochs - (0 if resumed_after is None else resumed_after + 1)
    what = f"{remaining} epoch checkpoint(s) of about {per_epoch:,} bytes each"
    require_free_space(ckpt, remaining * per_epoch, what)
    started = time.time()
    try:
        with reporting_disk_full(ckpt, what, remaining * per_epoch, per_epoch,
                                 "training resumes after the last complete epoch"):
            with source.serving(log) as data_flags:  # online: the server runs exactly this long
                argv += data_flags
                train(plan, argv, ckpt, metrics_log, on_cpu, gpus)
    except PipelineError:
        remove_incomplete_epochs(ckpt)  # a half-written epoch is never resumed; give its space back
        raise
    train_s = time.time() - started

    selected, best = selected_checkpoint(ckpt, settings, started)
    df = write_metrics_csv(metrics_log, settings.epochs, settings.draft_type, Path(args.metrics))
    aux_key = settings.type.aux_layers_key
    export_draft(ckpt / str(selected), Path(args.final), target, inputs.aux_layer_ids, aux_key)
    export_draft(untrained_src, Path(args.untrained), target, inputs.aux_layer_ids, aux_key)
    shutil.rmtree(untrained_src, ignore_errors=True)
    pruned = prune(ckpt, settings.keep_last, {best} if best is not None else set())

    summary = val_summary(df, selected)
    hs_record = source.record()
    outputs = {"final": args.final, "untrained": args.untrained, "metrics": args.metrics}
    if args.hs_record:
        atomic_write_json(args.hs_record, hs_record)
        outputs["hs_record"] = args.hs_record
    inputs_used = {"target": args.target, "target_manifest": args.target_manifest, "data": args.data}
    for key in ("hs_manifest", "tokenized_stats"):
        if getattr(args, key):
            inputs_used[key] = getattr(args, key)
    prov.write(args.provenance, inputs=inputs_used, outputs=outputs,
               selected_epoch=selected, best_epoch=best, resumed_after_epoch=resumed_after,
               training_history=training_history(ckpt), trainer_checkout=trainer_checkout,
               train_wall_s=round(train_s, 3), aux_layer_ids=inputs.aux_layer_ids,
               draft_type=settings.draft_type, draft_parameters=parameter_count(Path(args.final)),
               draft_vocab_size=settings.draft_vocab_size, draft_vocab_coverage=vocab_coverage,
               checkpoints=pruned, trainer_argv=argv,
               launch={"mode": plan.mode, "command": plan.command, "world_size": plan.world_size},
               hidden_states={k: hs_record.get(k) for k in ("mode", "storage", "transfer")},
               training_data=used.record,
               dtype_resolution=dtypes.job_record("train", settings.dtype, on_gpu=not on_cpu),
               **summary)
    log(f"final/ = epoch {selected} ({settings.select}); " +
        ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    run_main(main)
