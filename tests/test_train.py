"""Stage 6: train_draft.py (speculators' trainer on CPU, resume, pruning, final/untrained drafts,
refusals), pipeline_lib.launch (torchrun / srun command generation) and load_check.py (real vLLM).

The inputs come from the real upstream stages: materialize_target.py (local tiny target),
extract_hidden_states.py (transformers backend) and gather_hidden_states.py, run on a tokenized
dataset built here (chat-templated chitchat conversations, loss on assistant turns), laid out
as R/{target,tokenized,hidden_states} in docs/artifacts.md."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import PY, REPO, SCRIPTS, run_script, small_disk
from pipeline_lib import launch, speculators_cpu
from pipeline_lib.assets import resolve_asset
from pipeline_lib.errors import PipelineError
from pipeline_lib.training import checkpoints

AUX = [2, 4, 5]  # speculators' default for the 8-layer tiny target
ROWS = 24
SECRET = "hf_testsecretvalue123456"
SETTINGS = {"draft_layers": 1, "draft_vocab_size": 512, "ttt_steps": 3, "epochs": 1, "lr": 0.003,
            "optimizer": "adamw", "scheduler": "linear", "total_seq_len": 512,
            "train_data_ratio": 0.85, "attn_impl": "sdpa", "loss_impl": "eager", "seed": 0,
            "keep_last": 2, "select": "best", "num_workers": 0}


# ------------------------------------------------------------------------------ fixtures

def _conversations(n: int) -> list[list[dict]]:
    data = json.loads(Path(resolve_asset("pypi:chitchat_dataset/dataset.json")).read_text())
    out = []
    for conv in data.values():
        turns = [" ".join(m["text"] for m in turn) for turn in conv["messages"]]
        if len(turns) >= 2:
            out.append([{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns[:4])])
        if len(out) == n:
            return out
    return out


def build_tokenized(target: Path, out: Path, rows: int = ROWS, max_len: int = 96) -> dict[int, int]:
    """R/tokenized/{data, token_freq.pt}: int64 input_ids/loss_mask/seq_len, torch format."""
    import torch
    from datasets import Dataset, Features, Sequence, Value
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    cols, freq = {"input_ids": [], "loss_mask": [], "seq_len": []}, {}
    for msgs in _conversations(rows):
        ids, mask = [], []
        for j in range(len(msgs)):  # loss on assistant turns only
            new = tok.apply_chat_template(msgs[: j + 1], tokenize=True, return_dict=False)[len(ids):]
            ids += new
            mask += [int(msgs[j]["role"] == "assistant")] * len(new)
        ids, mask = ids[:max_len], mask[:max_len]
        cols["input_ids"].append(ids)
        cols["loss_mask"].append(mask)
        cols["seq_len"].append(len(ids))
        for t, m in zip(ids, mask):
            if m:
                freq[t] = freq.get(t, 0) + 1
    features = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    Dataset.from_dict(cols, features=features).with_format("torch").save_to_disk(str(out / "data"))
    torch.save(freq, out / "token_freq.pt")
    return freq


@pytest.fixture(scope="module")
def hs_run(tiny_target, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train")
    freq = build_tokenized(tiny_target, root / "tokenized")
    run_script("materialize_target.py", "--settings", json.dumps({"source": "local", "path": str(tiny_target)}),
               "--out-dir", root / "target" / "model", "--manifest", root / "target" / "manifest.json",
               "--provenance", root / "target" / "provenance.json", timeout=300)
    shard = root / "hidden_states" / "shards" / "0-of-1.json"
    run_script("extract_hidden_states.py", "--settings", json.dumps({"backend": "transformers", "batch_size": 8}),
               "--target", root / "target" / "model", "--manifest", root / "target" / "manifest.json",
               "--data", root / "tokenized" / "data", "--shard", "0", "--num-shards", "1",
               "--store-dir", root / "hidden_states" / "store", "--out", shard, timeout=300)
    run_script("gather_hidden_states.py", "--shards", shard, "--data", root / "tokenized" / "data",
               "--token-freq", root / "tokenized" / "token_freq.pt", "--out-data", root / "hidden_states" / "data",
               "--manifest", root / "hidden_states" / "manifest.json",
               "--provenance", root / "hidden_states" / "provenance.json", timeout=300)
    manifest = json.loads((root / "hidden_states" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == AUX and manifest["rows"] == ROWS
    return {"root": root, "target": root / "target" / "model", "freq": freq, "manifest": manifest,
            "data": root / "hidden_states" / "data", "hs_manifest": root / "hidden_states" / "manifest.json",
            "target_manifest": root / "target" / "manifest.json"}


def train_args(run: dict, settings: dict, out: Path, hs_manifest: Path | None = None,
               data: Path | None = None) -> list[str]:
    return ["--settings", json.dumps(settings), "--target", run["target"],
            "--target-manifest", run["target_manifest"], "--data", data or run["data"],
            "--hs-manifest", hs_manifest or run["hs_manifest"], "--checkpoints", out / "checkpoints",
            "--gpus", "0", "--nodes", "1", "--final", out / "final", "--untrained", out / "untrained",
            "--metrics", out / "train_metrics.csv", "--provenance", out / "provenance.json"]


@pytest.fixture(scope="module")
def trained(hs_run) -> dict:
    """Run 1 trains one epoch; run 2 asks for three with extend_epochs and must resume after
    epoch 0. A copy of run 1's checkpoints is kept for the start-over test."""
    out = hs_run["root"] / "drafts" / "default"
    first = run_script("train_draft.py", *train_args(hs_run, SETTINGS, out), timeout=600)
    first_rows = [json.loads(line) for line in (out / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    one_epoch = hs_run["root"] / "one-epoch-checkpoints"
    shutil.copytree(out / "checkpoints", one_epoch, symlinks=True)
    second = run_script("train_draft.py", *train_args(hs_run, {**SETTINGS, "epochs": 3, "extend_epochs": True}, out),
                        timeout=600, env={"HF_TOKEN": SECRET})
    return {"out": out, "first": first, "first_rows": first_rows, "second": second, "one_epoch": one_epoch}


def read_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# ---------------------------------------------------------------------- training on CPU

def test_first_run_trains_one_epoch_from_scratch(trained):
    log = trained["first"].stdout
    assert "No previous training checkpoint found" in log
    assert [(r["epoch"], r["split"]) for r in trained["first_rows"]] == [(0, "train"), (0, "val")]


def test_rerun_with_more_epochs_resumes_instead_of_retraining(trained):
    log = trained["second"].stdout
    assert "resuming after epoch 0" in log
    assert "Resuming training on epoch 1" in log
    assert "Training epoch 1/3 started" not in log  # epoch 0 is not trained again
    rows = [json.loads(line) for line in (trained["out"] / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    epoch0 = [r for r in rows if r["epoch"] == 0]
    assert epoch0 == trained["first_rows"]  # written once, by the first run
    second_run = {r["run_started"] for r in rows if r["epoch"] > 0}
    assert len(second_run) == 1 and second_run != {trained["first_rows"][0]["run_started"]}
    prov = json.loads((trained["out"] / "provenance.json").read_text())
    assert prov["resumed_after_epoch"] == 0
    # the extension is on record: a 1-epoch run, continued to 3 epochs
    history = [{k: v for k, v in h.items() if k != "started"} for h in prov["training_history"]]
    assert history == [{"epochs": 1, "resumed_after_epoch": None},
                       {"epochs": 3, "resumed_after_epoch": 0, "extended_from_epochs": 1}]
    assert "continuing a 1-epoch run to 3 epochs" in log


def test_more_epochs_without_extend_epochs_start_over(trained, hs_run, tmp_path):
    """The 1-epoch run's linear schedule decayed lr to 0 by its end: asking for 2 epochs must
    train 2 epochs from scratch, not resume from it. Its checkpoints are moved aside, kept."""
    out = tmp_path / "draft"
    shutil.copytree(trained["one_epoch"], out / "checkpoints", symlinks=True)
    proc = run_script("train_draft.py", *train_args(hs_run, {**SETTINGS, "epochs": 2}, out), timeout=600)
    assert "were made with different epochs (1 -> 2: the linear learning-rate schedule" in proc.stdout
    assert "set train.extend_epochs: true" in proc.stdout
    assert "resuming after epoch" not in proc.stdout and "Training epoch 1/2 started" in proc.stdout
    (aside,) = out.glob("checkpoints.superseded-*")
    assert (aside / "0" / "model.safetensors").exists()
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["resumed_after_epoch"] is None
    assert [h["resumed_after_epoch"] for h in prov["training_history"]] == [None]
    rows = [json.loads(line) for line in (out / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["split"]) for r in rows] == [(e, s) for e in range(2) for s in ("train", "val")]


def test_metrics_csv_has_a_row_per_epoch_and_split(trained):
    import pandas as pd

    df = pd.read_csv(trained["out"] / "train_metrics.csv")
    assert list(zip(df["epoch"], df["split"])) == [(e, s) for e in range(3) for s in ("train", "val")]
    for col in ["loss", "acc_0", "acc_1", "acc_2", "cond_acc_0", "full_acc_2", "loss_0"]:
        assert df[col].notna().all(), col
    assert ((df[["acc_0", "acc_1", "acc_2"]] >= 0) & (df[["acc_0", "acc_1", "acc_2"]] <= 1)).all().all()
    # acc_i is cumulative (tokens 0..i all right): it cannot grow with i
    assert (df["acc_0"] >= df["acc_1"]).all() and (df["acc_1"] >= df["acc_2"]).all()
    train = df[df["split"] == "train"].set_index("epoch")
    assert train.loc[2, "loss"] < train.loc[0, "loss"]  # it learned something
    assert (train["steps"] > 0).all() and (train["tokens_per_s"] > 0).all()
    assert train["tokens"].nunique() == 1  # every epoch sees the same training rows
    # Where each epoch's step time went (speculators' per-step profile): phases within the step time.
    phases = train[["fetch_s", "fwd_s", "bwd_s", "opt_s"]]
    assert (phases >= 0).all().all() and (train["fwd_s"] > 0).all() and (train["bwd_s"] > 0).all()
    assert (phases.sum(axis=1) <= train["step_s"] * 1.001).all()
    assert ((train["first_step_s"] > 0) & (train["first_step_s"] <= train["step_s"])).all()


def test_final_is_the_best_epoch_with_relative_verifier_path(trained, hs_run):
    import pandas as pd

    out = trained["out"]
    prov = json.loads((out / "provenance.json").read_text())
    df = pd.read_csv(out / "train_metrics.csv")
    val = df[df["split"] == "val"].set_index("epoch")["loss"]
    assert prov["selected_epoch"] == prov["best_epoch"] == int(val.idxmin())
    assert prov["val_loss"] == pytest.approx(val.min())

    assert sorted(p.name for p in (out / "final").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "final" / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == "../../../target/model"  # R/drafts/<variant>/final -> R/target/model
    assert (out / "final" / verifier).resolve() == hs_run["target"].resolve()
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["draft_vocab_size"] == 512
    # the selected epoch's weights, unchanged
    selected = read_safetensors(out / "checkpoints" / str(prov["selected_epoch"]) / "model.safetensors")
    final = read_safetensors(out / "final" / "model.safetensors")
    assert final.keys() == selected.keys() and all((final[k] == selected[k]).all() for k in final)


def test_draft_vocab_is_the_most_frequent_loss_tokens(trained, hs_run):
    import torch

    final = read_safetensors(trained["out"] / "final" / "model.safetensors")
    freq = hs_run["freq"]
    expected = sorted(sorted(freq, key=lambda t: (-freq[t], t))[:512])
    if len(expected) < 512:  # speculators fills up with the lowest unused ids
        expected = sorted(expected + [t for t in range(2048) if t not in freq][: 512 - len(expected)])
    d2t, t2d = final["d2t"], final["t2d"]
    assert (d2t + torch.arange(512)).tolist() == expected
    assert t2d.shape == (2048,) and int(t2d.sum()) == 512 and t2d[expected].all()
    # The coverage the report shows: the generated tokens this vocabulary can propose at all.
    cov = json.loads((trained["out"] / "provenance.json").read_text())["draft_vocab_coverage"]
    total = sum(freq.values())
    assert cov["generated_tokens"] == total and cov["distinct_generated_tokens"] == len(freq)
    assert cov["covered_tokens"] == sum(c for t, c in freq.items() if t in set(expected))
    assert cov["share"] == pytest.approx(cov["covered_tokens"] / total, abs=1e-6) and 0 < cov["share"] <= 1


def test_untrained_has_same_architecture_and_vocab_but_no_training(trained):
    out = trained["out"]
    final, untrained = (read_safetensors(out / d / "model.safetensors") for d in ("final", "untrained"))
    assert final.keys() == untrained.keys()
    assert all(final[k].shape == untrained[k].shape for k in final)
    assert (final["d2t"] == untrained["d2t"]).all() and (final["t2d"] == untrained["t2d"]).all()
    assert not (final["fc.weight"] == untrained["fc.weight"]).all()
    cfg_f, cfg_u = (json.loads((out / d / "config.json").read_text()) for d in ("final", "untrained"))
    assert cfg_u == cfg_f  # same architecture, vocab, aux ids and relative verifier path
    assert not (out / "checkpoints" / ".untrained-build").exists()


def test_checkpoints_pruned_to_keep_last_with_optimizer_only_in_latest(trained):
    ckpt = trained["out"] / "checkpoints"
    prov = json.loads((trained["out"] / "provenance.json").read_text())
    epochs = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert epochs == sorted({1, 2} | {prov["best_epoch"]})  # keep_last 2, plus the best
    assert (ckpt / "2" / "optimizer_state_dict.pt").exists() and (ckpt / "2" / "scheduler_state_dict.pt").exists()
    for n in epochs[:-1]:
        assert not (ckpt / str(n) / "optimizer_state_dict.pt").exists()
        assert (ckpt / str(n) / "model.safetensors").exists()
    assert (ckpt / "checkpoint_best").resolve() == (ckpt / str(prov["best_epoch"])).resolve()
    assert prov["checkpoints"]["removed"] == [e for e in range(3) if e not in epochs]


def test_select_last_takes_the_last_epoch_not_the_best(trained, hs_run, tmp_path):
    """train.select: last. The finished checkpoints of `trained` are copied and epoch 1 made the
    best one (its validation loss in the metrics log lowered, the best link pointed at it), so
    best and last differ for sure; the rerun resumes after the last epoch (nothing left to
    train) and must export epoch 2, not the best one."""
    out = tmp_path / "drafts" / "last"
    shutil.copytree(trained["out"] / "checkpoints", out / "checkpoints", symlinks=True)
    log = out / "checkpoints" / "metrics.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    lowest = min(r["metrics"]["loss"] for r in rows if r.get("split") == "val")
    for r in rows:
        if r.get("split") == "val" and r["epoch"] == 1:
            r["metrics"]["loss"] = lowest - 1.0
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    best = out / "checkpoints" / "checkpoint_best"
    best.unlink()
    best.symlink_to("1")
    proc = run_script("train_draft.py", *train_args(hs_run, {**SETTINGS, "epochs": 3, "select": "last"}, out),
                      timeout=600)
    assert "resuming after epoch 2" in proc.stdout
    prov = json.loads((out / "provenance.json").read_text())
    assert (prov["selected_epoch"], prov["best_epoch"], prov["settings"]["select"]) == (2, 1, "last")
    final = read_safetensors(out / "final" / "model.safetensors")
    for epoch, same in ((2, True), (1, False)):
        ckpt = read_safetensors(out / "checkpoints" / str(epoch) / "model.safetensors")
        assert all((final[k] == ckpt[k]).all() for k in final) is same, epoch


def test_torchrun_worker_path_trains_on_cpu_with_two_gloo_processes(trained, hs_run, tmp_path):
    """The multi-process path (torchrun -> --trainer-worker -> speculators' DDP) run for real:
    two processes on the CPU over gloo, each training on its half of the batches."""
    import pandas as pd

    out = tmp_path / "drafts" / "ddp"
    proc = run_script("train_draft.py", *train_args(hs_run, SETTINGS, out), "--cpu-processes", "2", timeout=600,
                      env={"OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert "launch torchrun" in log and "--nproc-per-node=2" in log and "--trainer-worker" in log
    ranks = re.findall(r"Started distributed on CPU \(gloo\) with local_rank=(\d), dp_size=2", log)
    assert sorted(ranks) == ["0", "1"], log[-3000:]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["launch"]["mode"] == "torchrun" and prov["launch"]["world_size"] == 2
    ddp = pd.read_csv(out / "train_metrics.csv").set_index(["epoch", "split"])
    single = pd.read_csv(trained["out"] / "train_metrics.csv").set_index(["epoch", "split"])
    # Data parallel: each rank steps through about half of the batches a single process takes.
    assert 0 < ddp.loc[(0, "train"), "steps"] < single.loc[(0, "train"), "steps"]
    assert ddp.loc[(0, "val"), "loss"] > 0
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX


def test_secrets_stay_out_of_provenance_and_log(trained):
    assert SECRET not in (trained["out"] / "provenance.json").read_text()
    assert SECRET not in trained["second"].stdout + trained["second"].stderr


PLANTED = ("hf_plantedSecretInAnEdit1234567890", "sk-plantedKeyInAStagedFile0987654321")


def test_uncommitted_edits_and_their_credentials_stay_out_of_checkpoints(hs_run, tmp_path):
    """speculators writes `git diff HEAD` of the checkout its package lives in (with `make env`,
    the pipeline's own: .venv is inside it) into the checkpoints as speculators.patch, so a
    user's uncommitted edits, credentials included, would travel with every draft. Here the
    package is imported from a dirty clone holding planted credentials, and an earlier run's
    patch lies in the checkpoints: no file under the job's outputs holds them afterwards, and
    provenance records that checkout's commit and the digest of its diff."""
    from test_secrets import files_holding

    clone = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True, timeout=120)
    with open(clone / "config.yaml", "a") as f:  # an edit of a tracked file
        f.write(f"\n# HF_TOKEN={PLANTED[0]}\n")
    (clone / "local.env").write_text(f"OPENAI_API_KEY={PLANTED[1]}\n")  # a new file, staged
    subprocess.run(["git", "-C", str(clone), "add", "local.env"], check=True)
    import speculators

    site = clone / ".venv" / "lib" / "site-packages"  # .venv is ignored: not part of the diff
    shutil.copytree(Path(speculators.__file__).parent, site / "speculators",
                    ignore=shutil.ignore_patterns("__pycache__"))
    diff = subprocess.run(["git", "-C", str(clone), "diff", "HEAD"], capture_output=True, check=True).stdout
    assert all(s.encode() in diff for s in PLANTED)

    out = tmp_path / "draft"
    (out / "checkpoints").mkdir(parents=True)  # what speculators left in an earlier run's checkpoints
    (out / "checkpoints" / "speculators.patch").write_bytes(diff)
    run_script("train_draft.py", *train_args(hs_run, SETTINGS, out), timeout=600,
               env={"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert files_holding(out, *PLANTED) == []
    assert not list(out.rglob("speculators.patch"))
    prov = json.loads((out / "provenance.json").read_text())
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert prov["trainer_checkout"] == {"path": str(clone.resolve()), "commit": head, "dirty": True,
                                        "diff_sha256": hashlib.sha256(diff).hexdigest()}


def _epoch(ckpt: Path, n: int, complete: bool = True, validated: bool = True) -> Path:
    d = ckpt / str(n)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_text(f"weights of epoch {n}")
    if complete:  # what speculators writes last when it saves an epoch (before validating it)
        (d / "training_state.json").write_text(json.dumps({"epoch": n, "local_step": 0, "global_step": 8 * (n + 1)}))
    if complete and validated:  # what train_draft's metrics recorder appends when validation ends
        with open(ckpt / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"epoch": n, "split": "val", "metrics": {"loss": 1.0 / (n + 1)}}) + "\n")
    return d


def test_checkpoints_of_other_settings_are_moved_aside_not_resumed(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _epoch(ckpt, 0)
    (ckpt / checkpoints.FINGERPRINT).write_text(json.dumps({"lr": 0.1, "target_digest": "a"}))
    assert checkpoints.prepare_checkpoints(ckpt, {"lr": 0.2, "target_digest": "a"}, epochs=3) is None
    (aside,) = tmp_path.glob("checkpoints.superseded-*")
    assert (aside / "0" / "model.safetensors").read_text() == "weights of epoch 0"
    assert json.loads((ckpt / checkpoints.FINGERPRINT).read_text()) == {"lr": 0.2, "target_digest": "a"}
    assert not checkpoints.epoch_dirs(ckpt)


def test_resume_skips_a_half_saved_epoch_and_longer_runs_start_fresh(tmp_path):
    ckpt, fp = tmp_path / "checkpoints", {"lr": 0.1}
    (ckpt).mkdir()
    (ckpt / checkpoints.FINGERPRINT).write_text(json.dumps(fp))
    _epoch(ckpt, 0), _epoch(ckpt, 1), _epoch(ckpt, 2, complete=False)  # killed while saving 2
    assert checkpoints.prepare_checkpoints(ckpt, fp, epochs=3) == 1
    assert not (ckpt / "2").exists() and (ckpt / "1" / "model.safetensors").exists()
    # asking for fewer epochs than already trained cannot resume: moved aside, fresh start
    assert checkpoints.prepare_checkpoints(ckpt, fp, epochs=1) is None
    assert len(list(tmp_path.glob("checkpoints.superseded-*"))) == 1


def test_an_epoch_saved_but_not_validated_is_not_resumed_past(tmp_path):
    """speculators saves an epoch, then validates it: killed in between, the epoch's metrics and
    its best-epoch candidacy were never recorded, so it is trained again."""
    ckpt, fp = tmp_path / "checkpoints", {"lr": 0.1}
    ckpt.mkdir()
    (ckpt / checkpoints.FINGERPRINT).write_text(json.dumps(fp))
    _epoch(ckpt, 0), _epoch(ckpt, 1, validated=False)
    with open(ckpt / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 1, "split": "tr')  # and a torn line of the killed append
    assert checkpoints.prepare_checkpoints(ckpt, fp, epochs=3) == 0
    assert not (ckpt / "1").exists() and checkpoints.best_epoch(ckpt) == 0


def test_a_torn_end_of_epoch_marker_is_not_trusted(tmp_path):
    ckpt, fp = tmp_path / "checkpoints", {"lr": 0.1}
    ckpt.mkdir()
    (ckpt / checkpoints.FINGERPRINT).write_text(json.dumps(fp))
    _epoch(ckpt, 0)
    (_epoch(ckpt, 1, complete=False) / "training_state.json").write_text('{"epoch": 1, "local_')  # killed mid-write
    assert checkpoints.prepare_checkpoints(ckpt, fp, epochs=3) == 0
    assert not (ckpt / "1").exists()


@pytest.mark.parametrize("scheduler, extend, resumes", [
    ("linear", False, False),   # lr decays over the epochs: another trajectory, start over
    ("cosine", False, False),
    ("linear", True, True),     # explicitly asked for: continue, and record it
    ("none", False, True),      # constant lr: more epochs are the same trajectory, continued
])
def test_epochs_change_resumes_only_when_the_schedule_allows_or_asked(tmp_path, scheduler, extend, resumes):
    ckpt = tmp_path / "checkpoints"
    fp = {"lr": 0.1, "scheduler": scheduler, "epochs": 4}
    checkpoints.prepare_checkpoints(ckpt, fp, epochs=4)
    for n in range(4):
        _epoch(ckpt, n)
    got = checkpoints.prepare_checkpoints(ckpt, {**fp, "epochs": 8}, epochs=8, extend_epochs=extend)
    assert got == (3 if resumes else None)
    assert bool(list(tmp_path.glob("checkpoints.superseded-*"))) is not resumes
    history = checkpoints.training_history(ckpt)
    if resumes:
        assert [h["epochs"] for h in history] == [4, 8]
        assert history[1]["resumed_after_epoch"] == 3 and history[1]["extended_from_epochs"] == 4
    else:
        assert [(h["epochs"], h["resumed_after_epoch"]) for h in history] == [(8, None)]
    # any other knob that shapes the trajectory never resumes, extend_epochs or not
    assert checkpoints.prepare_checkpoints(ckpt, {**fp, "epochs": 8, "lr": 0.2}, epochs=8, extend_epochs=True) is None


def test_full_disk_while_saving_an_epoch_fails_clearly_and_rerun_resumes(hs_run, tmp_path):
    """Checkpoints on a small real filesystem (tmpfs); once epoch 0 is saved another writer
    takes the space. Saving epoch 1 fails: a clear error naming the checkpoint dir and the
    bytes the plan expected, the half-written epoch removed (never resumed), epoch 0 and no
    output kept. With space freed the rerun resumes after epoch 0 and finishes."""
    settings = {**SETTINGS, "epochs": 2}
    with small_disk(tmp_path / "disk", 24 << 20) as disk:
        out = disk.path / "draft"
        ckpt = out / "checkpoints"
        marker = ckpt / "0" / "training_state.json"
        filled = []

        def fill_after_epoch_0():
            deadline = time.time() + 300
            while not marker.exists() and time.time() < deadline:
                time.sleep(0.02)
            filled.append(disk.fill(leave=512 << 10))  # less than one epoch checkpoint (~2 MB)

        watcher = threading.Thread(target=fill_after_epoch_0, daemon=True)
        watcher.start()
        proc = subprocess.run([PY, str(SCRIPTS / "train_draft.py"), *map(str, train_args(hs_run, settings, out))],
                              capture_output=True, text=True, timeout=600)
        watcher.join(timeout=5)
        assert filled and proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        err = proc.stderr
        assert f"\nERROR: {ckpt}: the disk is full (" in err, err[-3000:]
        assert "while writing 2 epoch checkpoint(s) of about" in err and "the plan expected" in err
        assert "training resumes after the last complete epoch" in err and "Traceback" not in err
        assert sorted(train_draft_epochs(ckpt)) == [0] and not (ckpt / "1").exists()
        assert not (out / "final").exists() and not (out / "provenance.json").exists()

        filled[0].unlink()
        rerun = run_script("train_draft.py", *train_args(hs_run, settings, out), timeout=600)
        assert "resuming after epoch 0" in rerun.stdout and "Training epoch 1/2 started" not in rerun.stdout
        prov = json.loads((out / "provenance.json").read_text())
        assert prov["resumed_after_epoch"] == 0 and (out / "final" / "model.safetensors").exists()


def train_draft_epochs(ckpt: Path) -> list[int]:
    return list(checkpoints.epoch_dirs(ckpt, complete_only=False))


# ------------------------------------------------------------------------------ refusals

def _refused(hs_run, tmp_path, settings=None, hs_manifest=None, data=None) -> str:
    out = tmp_path / "draft"
    proc = run_script("train_draft.py", *train_args(hs_run, settings or SETTINGS, out, hs_manifest, data),
                      check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "final").exists() and not (out / "checkpoints").exists()
    return proc.stderr


def _manifest_variant(hs_run, tmp_path, **changes) -> Path:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({**hs_run["manifest"], **changes}))
    return path


def test_refuses_hidden_states_of_another_target(hs_run, tmp_path):
    err = _refused(hs_run, tmp_path, hs_manifest=_manifest_variant(hs_run, tmp_path, target_digest="sha256:0123"))
    assert "target_digest sha256:0123 differs" in err and "re-run the hidden_states stage" in err


@pytest.mark.parametrize("ids, needle", [([2, 4], "hidden_states shape [" ), ([2, 4, 9], "out of range")])
def test_refuses_layer_ids_that_do_not_fit(hs_run, tmp_path, ids, needle):
    err = _refused(hs_run, tmp_path, hs_manifest=_manifest_variant(hs_run, tmp_path, aux_layer_ids=ids))
    assert needle in err and "aux_layer_ids" in err


def test_refuses_draft_vocab_larger_than_target_vocab(hs_run, tmp_path):
    err = _refused(hs_run, tmp_path, settings={**SETTINGS, "draft_vocab_size": 4096})
    assert "train.draft_vocab_size = 4096" in err and "2048" in err


def test_refuses_empty_dataset(hs_run, tmp_path):
    err = _refused(hs_run, tmp_path, hs_manifest=_manifest_variant(hs_run, tmp_path, rows=0, files={}, tokens=0))
    assert "dataset is empty" in err


def test_refuses_data_dir_out_of_sync_with_manifest(hs_run, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(hs_run["data"], data, copy_function=os.link)
    (data / "hidden_states" / "hs_7.safetensors").unlink()
    err = _refused(hs_run, tmp_path, data=data)
    assert "23 hidden-state files for 24 rows" in err and "hs_7.safetensors" in err


def test_refuses_gpu_only_settings_on_cpu(hs_run, tmp_path):
    err = _refused(hs_run, tmp_path, settings={**SETTINGS, "attn_impl": "simple_flex_attention",
                                                "loss_impl": "fused"})
    assert "train.attn_impl" in err and "train.loss_impl" in err


def test_refuses_gpus_when_none_is_visible(hs_run, tmp_path):
    args = train_args(hs_run, SETTINGS, tmp_path / "draft")
    args[args.index("--gpus") + 1] = "2"
    proc = run_script("train_draft.py", *args, check=False, timeout=300)
    assert proc.returncode == 2 and "--gpus 2 but no CUDA device is visible" in proc.stderr


def test_cpu_shims_refuse_other_speculators_versions(monkeypatch):
    assert speculators_cpu.installed_version() == speculators_cpu.SUPPORTED_VERSION
    monkeypatch.setattr(speculators_cpu, "installed_version", lambda: "0.10.0")
    with pytest.raises(PipelineError, match="speculators 0.10.0 is installed"):
        speculators_cpu.apply()


def test_help_works():
    for script in ("train_draft.py", "load_check.py"):
        proc = run_script(script, "--help", timeout=120)
        assert "--settings" in proc.stdout


# ------------------------------------------------------------------------ launch commands

WORKER = ["/repo/scripts/train_draft.py", "--trainer-worker", "/r/ckpt/.trainer-worker.json"]


def test_one_gpu_or_cpu_trains_in_process():
    for gpus in (0, 1):
        plan = launch.plan(launch.LaunchRequest(gpus=gpus, nodes=1, worker=WORKER, environ={}))
        assert plan.in_process and plan.mode == "in_process" and plan.command == []


def test_several_gpus_launch_torchrun_one_process_per_gpu():
    plan = launch.plan(launch.LaunchRequest(gpus=4, nodes=1, worker=WORKER, python="/venv/bin/python",
                                            environ={}))
    assert plan.command == ["/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                            "--nproc-per-node=4", "--max-restarts=0", *WORKER]
    assert plan.world_size == 4


def test_several_nodes_launch_srun_torchrun_with_rendezvous_on_first_node():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
           "SLURM_CPUS_PER_TASK": "16"}
    seen = []
    plan = launch.plan(launch.LaunchRequest(gpus=8, nodes=2, worker=WORKER, python="/venv/bin/python",
                                            environ=env, head_node=lambda nl: seen.append(nl) or "gpu07"))
    assert seen == ["gpu[07-08]"]
    assert plan.command == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "/venv/bin/python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
        "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:29742", "--rdzv-id=4242", "--max-restarts=0", *WORKER]
    assert plan.env["SRUN_CPUS_PER_TASK"] == "16" and plan.world_size == 8
    port = launch.plan(launch.LaunchRequest(gpus=2, nodes=2, worker=WORKER, environ={**env, "MASTER_PORT": "31000"},
                                            head_node=lambda nl: "gpu07"))
    assert "--rdzv-endpoint=gpu07:31000" in port.command


@pytest.mark.parametrize("gpus, nodes, env, needle", [
    (8, 2, {}, "inside a SLURM allocation"),
    (6, 4, {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-4]"}, "must split evenly"),
    (1, 2, {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}, "at least one GPU per node"),
    (4, 2, {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"}, "allocation has 1 node"),
])
def test_multi_node_requests_that_cannot_work_are_refused(gpus, nodes, env, needle):
    with pytest.raises(PipelineError, match=needle):
        launch.plan(launch.LaunchRequest(gpus=gpus, nodes=nodes, worker=WORKER, environ=env,
                                         head_node=lambda nl: "n1"))


# ----------------------------------------------------------------------- vLLM load check

@pytest.mark.parametrize("which", ["final", "untrained"])
def test_vllm_loads_the_draft_as_eagle3_speculator(trained, hs_run, which):
    out = trained["out"] / f"load_check_{which}.json"
    run_script("load_check.py", "--target", hs_run["target"], "--draft", trained["out"] / which,
               "--out", out, timeout=600)
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["tokens"] > 0
    assert result["spec_decode"]["num_drafts"] > 0 and result["spec_decode"]["num_draft_tokens"] > 0
    assert result["aux_layer_ids"] == AUX and result["draft_vocab_size"] == 512
    # vLLM's own speculators-config resolution, run from the draft dir, finds the target
    assert result["verifier_path"]["relative"] and result["verifier_path"]["resolves_to_target"]
    assert result["vllm_version"]


def test_load_check_refuses_a_draft_without_aux_layer_ids(trained, hs_run, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(trained["out"] / "final", draft)
    config = json.loads((draft / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (draft / "config.json").write_text(json.dumps(config))
    proc = run_script("load_check.py", "--target", hs_run["target"], "--draft", draft, "--out",
                      tmp_path / "lc.json", check=False, timeout=300)
    assert proc.returncode == 2 and "eagle_aux_hidden_state_layer_ids is missing" in proc.stderr
    assert not (tmp_path / "lc.json").exists()


def test_load_check_fails_with_vllms_own_message(trained, hs_run, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(trained["out"] / "final", draft)
    config = json.loads((draft / "config.json").read_text())
    config["transformer_layer_config"]["intermediate_size"] *= 3  # weights no longer fit the config
    (draft / "config.json").write_text(json.dumps(config))
    proc = run_script("load_check.py", "--target", hs_run["target"], "--draft", draft, "--out",
                      tmp_path / "lc.json", check=False, timeout=600)
    assert proc.returncode == 2
    assert "vLLM could not run" in proc.stderr and "exceeds dimension size" in proc.stderr
    assert not (tmp_path / "lc.json").exists()


@pytest.mark.needs_root(why="it asks SLURM's scontrol to expand a node list", slurm=True, root=False)
def test_first_host_expands_a_slurm_nodelist_with_scontrol(tmp_path, monkeypatch):
    # scontrol needs a configuration source even to expand host names; on a compute node that
    # is the cluster's slurm.conf, here a minimal one (the SLURM test cluster removes its own).
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost Default=YES\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert launch.first_host("gpu[07-08],cpu3") == "gpu07"
