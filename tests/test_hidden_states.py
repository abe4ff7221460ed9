"""Stage 5, hidden states: both backends on the tiny target, the store's reuse/regenerate
logic, the gathered speculators data dir, and the errors bad input gets.

Expensive things run once per module: one vLLM extraction (the script, 1 shard) and one
Snakemake run of the real rules hidden_states_shard (2 shards, transformers backend) and
hidden_states_gather. The tests then inspect what they produced."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PY, SCRIPTS, base_test_config, run_script, run_snakemake, small_disk

from pipeline_lib.digests import file_digest, json_digest, path_digest
from pipeline_lib.errors import PipelineError
from pipeline_lib.hidden_states import (
    BACKENDS, FileRecord, HSStore, LayerSpec, Row, connector_config, inspect_hs_bytes, shard_range,
)
from pipeline_lib.provenance import Provenance

RUN = "results/tiny"
# (user, reasoning, answer): varied lengths, some with a thinking section.
CONVERSATIONS = [
    ("hi there", None, "hello! how are you today?"),
    ("what is the weather like in paris in spring?", "spring in paris is mild", "mild, with rain and sun."),
    ("tell me a story", "a short one " * 4, "once upon a time " * 10),
    ("ok", None, "sure."),
    ("name three colors", "primary colors", "red, green and blue"),
    ("why?", None, "because " * 25),
]
AUX = [2, 4, 5]  # speculators' default for the 8-layer tiny target
TOL_MAX_REL_ERR = 0.03  # per-token relative L2 error; bf16 rounding alone is ~0.4% per value
TOL_MIN_COSINE = 0.999


# --------------------------------------------------------------------------------------
# Upstream artifacts, built the way the target and tokenize rules describe them
# --------------------------------------------------------------------------------------

def tokenize(target: Path, out_data: Path) -> list[list[int]]:
    """speculators' format: save_to_disk, torch format, int64 input_ids/loss_mask/seq_len."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for user, reasoning, answer in CONVERSATIONS:
        prompt = [{"role": "user", "content": user}]
        reply = {"role": "assistant", "content": answer, **({"reasoning_content": reasoning} if reasoning else {})}
        head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(prompt + [reply], tokenize=False)
        n_head = len(tok(head, add_special_tokens=False)["input_ids"])
        ids = tok(full, add_special_tokens=False)["input_ids"]
        cols["input_ids"].append(ids)
        cols["loss_mask"].append([0] * n_head + [1] * (len(ids) - n_head))
        cols["seq_len"].append(len(ids))
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    datasets.Dataset.from_dict(cols, features=features).with_format("torch").save_to_disk(str(out_data))
    return cols["input_ids"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_target) -> Path:
    """A Snakemake workdir holding the target and tokenized artifacts of run 'tiny'."""
    wd = tmp_path_factory.mktemp("hs")
    run = wd / RUN
    shutil.copytree(tiny_target, run / "target" / "model")
    weights = sorted((p.name, file_digest(p)) for p in (run / "target" / "model").glob("*.safetensors"))
    config = json.loads((tiny_target / "config.json").read_text())
    (run / "target" / "manifest.json").write_text(json.dumps({
        "weights_digest": json_digest(weights), "num_hidden_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"], "dtype": "bfloat16"}))
    tok = run / "tokenized"
    input_ids = tokenize(tiny_target, tok / "data")
    counts: dict[int, int] = {}
    for ids in input_ids:
        for t in ids:
            counts[t] = counts.get(t, 0) + 1
    torch.save(counts, tok / "token_freq.pt")
    Provenance("tokenize", {}).write(tok / "provenance.json", inputs={},
                                     outputs={"data": tok / "data", "token_freq": tok / "token_freq.pt"})
    return wd


@pytest.fixture(scope="module")
def input_ids(workdir) -> list[list[int]]:
    import datasets

    data = datasets.load_from_disk(str(workdir / RUN / "tokenized" / "data")).with_format(None)
    return [list(r) for r in data["input_ids"]]


def extract_args(workdir: Path, store: Path, out: Path, shard: int = 0, num_shards: int = 1) -> list:
    run = workdir / RUN
    return ["--target", run / "target" / "model", "--manifest", run / "target" / "manifest.json",
            "--data", run / "tokenized" / "data", "--shard", shard, "--num-shards", num_shards,
            "--store-dir", store, "--out", out]


# --------------------------------------------------------------------------------------
# The two expensive runs
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_shard(workdir) -> dict:
    """Real vLLM (CPU build, our CPU-safe connector), one shard over every row."""
    out = workdir / "vllm" / "shard.json"
    t0 = time.monotonic()
    run_script("extract_hidden_states.py", "--settings", json.dumps({"backend": "vllm"}),
               *extract_args(workdir, workdir / "vllm" / "store", out), timeout=600)
    summary = json.loads(out.read_text())
    summary["wall_s"] = time.monotonic() - t0
    return summary


@pytest.fixture(scope="module")
def pipeline_run(workdir, tiny_target) -> Path:
    """The real rules through Snakemake: 2 transformers shards, then the gather."""
    config = base_test_config(tiny_target)
    # bfloat16 set, not `auto` (float32 on a CPU without bf16 instructions): the store key and the
    # files must be those of the by-hand runs here, whose settings give none (bfloat16).
    config["hidden_states"] = {"backend": "transformers", "num_shards": 2, "batch_size": 4, "dtype": "bfloat16"}
    # One core per shard job, so Snakemake runs both shards at once on a 2-core CI machine.
    config["resources"] = {"hidden_states": {"threads": 1, "mem_mb": 4000, "runtime": 30, "gpu": 0}}
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(PY).parent}{os.pathsep}{old_path}"  # rules call `python`
    try:
        run_snakemake(workdir, config, f"{RUN}/hidden_states/manifest.json",
                      "--allowed-rules", "hidden_states_shard", "hidden_states_gather", timeout=600)
    finally:
        os.environ["PATH"] = old_path
    return workdir / RUN / "hidden_states"


def shard_jsons(hs_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((hs_dir / "shards").glob("*-of-2.json"))]


def store_of(shard: dict, workdir: Path) -> Path:
    """A shard's store dir; under Snakemake it is relative to the workdir (results/ can move)."""
    return workdir / shard["store_dir"]  # an absolute store_dir stays as it is


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["extract_hidden_states.py", "gather_hidden_states.py"])
def test_help(script):
    proc = run_script(script, "--help", timeout=60)
    assert "--settings" in proc.stdout and "speculators" in proc.stdout


def test_shard_ranges_tile_rows():
    for rows in (0, 1, 5, 6, 7, 100):
        for n in (1, 2, 3, 8):
            ranges = [shard_range(rows, i, n) for i in range(n)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_vllm_connector_per_platform_and_length_limit(tiny_target):
    """CUDA keeps vLLM's stock connector; CPU loads ours from pipeline_lib (the module the
    engine processes import through PYTHONPATH)."""
    from pipeline_lib.cpu_hs_connector import CpuHiddenStatesConnector  # imports vLLM: only here

    assert "kv_connector_module_path" not in connector_config(cuda=True)
    cpu = connector_config(cuda=False)
    assert cpu["kv_connector"] == CpuHiddenStatesConnector.__name__
    assert cpu["kv_connector_module_path"] == CpuHiddenStatesConnector.__module__
    assert cpu["kv_connector_extra_config"]["allow_custom_save_path"] is True
    spec = LayerSpec(tuple(AUX), 8, 128, "bfloat16", max_positions=64)
    with pytest.raises(PipelineError, match="64 tokens; vLLM needs one position more"):
        BACKENDS["vllm"](tiny_target, spec, {}, max_len=64)


def test_backends_agree(vllm_shard, pipeline_run, workdir, input_ids):
    """The interchangeability contract: same token ids, values within bf16 tolerance."""
    tf_shards = shard_jsons(pipeline_run)
    assert vllm_shard["store_key"] == tf_shards[0]["store_key"]  # same inputs -> same store key
    v_dir, t_dir = Path(vllm_shard["store_dir"]), store_of(tf_shards[0], workdir)
    worst_rel, worst_cos = 0.0, 1.0
    for i, ids in enumerate(input_ids):
        v, t = load_file(v_dir / f"hs_{i}.safetensors"), load_file(t_dir / f"hs_{i}.safetensors")
        assert v["token_ids"].tolist() == t["token_ids"].tolist() == ids
        assert v["hidden_states"].shape == t["hidden_states"].shape == (len(ids), len(AUX) + 1, 128)
        assert v["hidden_states"].dtype == t["hidden_states"].dtype == torch.bfloat16
        a, b = v["hidden_states"].float(), t["hidden_states"].float()
        worst_rel = max(worst_rel, ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item())
        worst_cos = min(worst_cos, torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item())
    tf_tps = [s["tokens_per_s"] for s in tf_shards]
    print(f"\nvllm vs transformers over {len(input_ids)} rows: max per-token relative error {worst_rel:.2e}, "
          f"min cosine {worst_cos:.6f}; tokens/s vllm {vllm_shard['tokens_per_s']} "
          f"(engine start {vllm_shard['startup_s']} s, script {vllm_shard['wall_s']:.0f} s), transformers {tf_tps}")
    assert worst_rel < TOL_MAX_REL_ERR and worst_cos > TOL_MIN_COSINE
    assert vllm_shard["tokens_per_s"] > 0 and all(t > 0 for t in tf_tps)


def test_transformers_matches_reference_forward(pipeline_run, workdir, input_ids):
    """Layer-id semantics: id k = output_hidden_states[k] (residual entering layer k), id N =
    the last layer's output before the final norm (transformers returns the normed one)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workdir / RUN / "target" / "model", dtype=torch.bfloat16)
    pre_norm = {}
    model.model.norm.register_forward_pre_hook(lambda mod, args: pre_norm.__setitem__("x", args[0]))
    store = store_of(shard_jsons(pipeline_run)[0], workdir)
    i = max(range(len(input_ids)), key=lambda r: len(input_ids[r]))  # longest row: no padding in its batch
    with torch.no_grad():
        out = model(torch.tensor([input_ids[i]]), output_hidden_states=True)
    ref = torch.stack([out.hidden_states[k][0] for k in AUX] + [pre_norm["x"][0]], dim=1)
    assert not torch.equal(ref[:, -1], out.hidden_states[-1][0])  # the normed state would be wrong
    got = load_file(store / f"hs_{i}.safetensors")["hidden_states"]
    assert torch.allclose(got.float(), ref.float(), rtol=0.02, atol=0.02)


def test_gathered_dir_is_speculators_data(pipeline_run, workdir, input_ids):
    from speculators.train.data import ArrowDataset

    data = pipeline_run / "data"
    manifest = json.loads((pipeline_run / "manifest.json").read_text())
    shards = shard_jsons(pipeline_run)
    assert manifest["aux_layer_ids"] == AUX and manifest["final_layer_id"] == 8
    assert manifest["hidden_size"] == 128 and manifest["dtype"] == "bfloat16" and manifest["backend"] == "transformers"
    assert manifest["rows"] == len(input_ids) and manifest["tokens"] == sum(map(len, input_ids))
    assert manifest["bytes"] == sum((data / "hidden_states" / n).stat().st_size for n in manifest["files"])
    assert [s["row_range"] for s in shards] == [[0, 3], [3, 6]]
    # Hard links into the store, digests that match the bytes.
    store = store_of(shards[0], workdir)
    for name, digest in manifest["files"].items():
        assert (data / "hidden_states" / name).stat().st_ino == (store / name).stat().st_ino
        assert file_digest(data / "hidden_states" / name) == digest
    assert (data / "token_freq.pt").stat().st_ino == (workdir / RUN / "tokenized" / "token_freq.pt").stat().st_ino
    # The provenance's data digest (computed from known digests) is the real one.
    prov = json.loads((pipeline_run / "provenance.json").read_text())
    assert prov["outputs"]["data"]["digest"] == path_digest(data)
    # speculators' own reader, as the trainer builds it, refuses nothing and generates nothing.
    train = ArrowDataset(max_len=512, datapath=str(data), on_missing="raise", train_ratio=0.5, split="train")
    val = ArrowDataset(max_len=512, datapath=str(data), on_missing="raise", train_ratio=0.5, split="val")
    items = [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
    assert len(items) == len(input_ids)
    for item, ids in zip(items, input_ids):
        assert item["input_ids"].tolist() == ids
        assert item["hidden_states"].shape == (len(ids), len(AUX) * 128)
        assert item["verifier_last_hidden_states"].shape == (len(ids), 128)


def test_vllm_output_gathers_and_reads(vllm_shard, workdir, tmp_path):
    from speculators.train.data import ArrowDataset

    tok = workdir / RUN / "tokenized"
    run_script("gather_hidden_states.py", "--shards", workdir / "vllm" / "shard.json", "--data", tok / "data",
               "--token-freq", tok / "token_freq.pt", "--out-data", tmp_path / "data",
               "--manifest", tmp_path / "manifest.json", "--provenance", tmp_path / "provenance.json", timeout=120)
    assert json.loads((tmp_path / "manifest.json").read_text())["backend"] == "vllm"
    ds = ArrowDataset(max_len=512, datapath=str(tmp_path / "data"), on_missing="raise")
    assert ds[len(ds) - 1]["verifier_last_hidden_states"].dtype == torch.bfloat16
    # The connector's lock files and temp names are all gone: the store holds final files only.
    assert sorted(p.name for p in Path(vllm_shard["store_dir"]).iterdir()) == sorted(vllm_shard["files"])


def test_switching_backend_reuses_store(vllm_shard, workdir):
    """The store key leaves the backend out: the other backend finds every file valid and
    loads no model."""
    out = workdir / "vllm" / "rerun-transformers.json"
    run_script("extract_hidden_states.py", "--settings", json.dumps({"backend": "transformers"}),
               *extract_args(workdir, workdir / "vllm" / "store", out), timeout=120)
    summary = json.loads(out.read_text())
    assert (summary["reused"], summary["regenerated"], summary["startup_s"]) == (6, 0, 0.0)
    assert summary["files"] == vllm_shard["files"]


def test_rerun_regenerates_only_bad_files(pipeline_run, workdir, tmp_path, input_ids):
    src = store_of(shard_jsons(pipeline_run)[0], workdir)
    store = tmp_path / "store" / src.name
    shutil.copytree(src, store)
    # Shard 0 of 2 owns rows 0..2. Row 1: truncated (an interrupted copy); row 2: another
    # row's file (token ids differ); row 0 stays good. Temp files of an interrupted write:
    # one for row 0 (ours: removed), one for row 4 (shard 1's: left alone).
    data = (store / "hs_1.safetensors").read_bytes()
    (store / "hs_1.safetensors").write_bytes(data[:len(data) // 2])
    shutil.copyfile(store / "hs_3.safetensors", store / "hs_2.safetensors")
    ours, theirs = store / ".hs_0.safetensors.4242-vllm.tmp", store / ".hs_4.safetensors.4242-vllm.tmp"
    for p in (ours, theirs, Path(f"{ours}.lock")):
        p.write_bytes(b"partial")
    # A write killed in the current layout: its own directory, holding safetensors' temp file.
    ours_dir = store / ".hs_0.safetensors.4243-vllm.tmp"
    ours_dir.mkdir()
    (ours_dir / ".tmpAbC123").write_bytes(b"partial")
    old = {i: (store / f"hs_{i}.safetensors").stat().st_mtime_ns for i in range(6)}
    time.sleep(0.01)

    out = tmp_path / "shard.json"
    run_script("extract_hidden_states.py", "--settings", json.dumps({"backend": "transformers"}),
               *extract_args(workdir, tmp_path / "store", out, shard=0, num_shards=2), timeout=300)
    summary = json.loads(out.read_text())
    assert (summary["reused"], summary["regenerated"]) == (1, 2)
    assert set(summary["invalid"]) == {"1", "2"}
    assert "unreadable" in summary["invalid"]["1"] and "token_ids" in summary["invalid"]["2"]
    assert summary["removed_temp_files"] == 3 and not ours.exists() and not ours_dir.exists() and theirs.exists()
    new = {i: (store / f"hs_{i}.safetensors").stat().st_mtime_ns for i in range(6)}
    assert new[0] == old[0] and all(new[i] == old[i] for i in (3, 4, 5))  # untouched
    assert new[1] != old[1] and new[2] != old[2]
    spec = LayerSpec(tuple(AUX), 8, 128, "bfloat16")
    for i in (1, 2):
        assert inspect_hs_bytes((store / f"hs_{i}.safetensors").read_bytes(), input_ids[i], spec) is None
        regenerated = load_file(store / f"hs_{i}.safetensors")["hidden_states"].float()
        original = load_file(src / f"hs_{i}.safetensors")["hidden_states"].float()
        assert torch.allclose(regenerated, original, rtol=0.02, atol=0.02)  # batch padding differs


def test_interrupted_or_invalid_write_leaves_no_final_file(tmp_path, monkeypatch):
    spec = LayerSpec((1,), 2, 4, "bfloat16")
    store = HSStore(tmp_path, spec)
    row = Row(7, [5, 6, 7])
    good = torch.ones(3, 2, 4, dtype=torch.bfloat16)

    def killed(*args):
        raise KeyboardInterrupt  # the job dies between writing the temp file and renaming it

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store.write(row, good)
    monkeypatch.undo()
    assert not store.path(7).exists() and list(tmp_path.iterdir()) == []

    # A backend file with the wrong shape is refused and keeps its temp name.
    temp = store.temp_path(7, "test")
    save_file({"hidden_states": torch.ones(3, 3, 4, dtype=torch.bfloat16),
               "token_ids": torch.tensor(row.input_ids)}, str(temp))
    with pytest.raises(RuntimeError, match="row 7.*shape"):
        store.commit(row, temp)
    assert not store.path(7).exists()
    assert store.check(row) == "missing"
    assert store.clean_temps(range(7, 8)) == [temp.parent.name] and not temp.parent.exists()

    bad = good.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        store.write(row, bad)
    assert store.write(row, good).tokens == 3 and isinstance(store.check(row), FileRecord)
    assert store.check(Row(7, [5, 6, 8])) == "token_ids differ from the dataset's input_ids"


def test_full_disk_fails_naming_store_and_bytes_and_rerun_continues(workdir, input_ids, tmp_path):
    """The store on a small real filesystem (tmpfs) that another writer fills after the plan
    check passed: the shard fails naming the store and the bytes the plan expected, keeps the
    files it finished (all valid), leaves no temp file; after space is freed the rerun reuses
    them and extracts only the rest, byte-identical to an uninterrupted run."""
    settings = json.dumps({"backend": "transformers", "batch_size": 1})  # one file per forward
    spec = LayerSpec(tuple(AUX), 8, 128, "bfloat16")
    ref_out = tmp_path / "ref.json"
    run_script("extract_hidden_states.py", "--settings", settings,
               *extract_args(workdir, tmp_path / "ref-store", ref_out), timeout=300)
    ref = json.loads(ref_out.read_text())
    expected = sum(spec.file_bytes(len(ids)) for ids in input_ids)
    assert sum(ref["file_bytes"].values()) <= expected < 1.1 * sum(ref["file_bytes"].values())
    sizes = sorted(ref["file_bytes"].values())  # the backend writes the shortest rows first
    pages = [-(-n // 4096) * 4096 for n in sizes]

    # Too small from the start: refused before the model is loaded.
    with small_disk(tmp_path / "tiny-disk", expected // 2) as disk:
        out = tmp_path / "refused.json"
        proc = run_script("extract_hidden_states.py", "--settings", settings,
                          *extract_args(workdir, disk.path / "store", out), check=False, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "not enough disk space for the hidden states of 6 row(s) of shard 0 of 1: the plan expects" \
               in proc.stderr and f"({expected:,} bytes)" in proc.stderr
        assert not list((disk.path / "store").rglob("*.safetensors"))

    with small_disk(tmp_path / "disk", expected + (1 << 20)) as disk:
        store_root = disk.path / "store"
        out = tmp_path / "shard.json"
        cmd = [PY, str(SCRIPTS / "extract_hidden_states.py"), "--settings", settings,
               *map(str, extract_args(workdir, store_root, out))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = []
        for line in proc.stderr:  # the plan check passed: now another writer takes the space
            log.append(line)
            if "disk: the hidden states of 6 row(s) of shard 0 of 1 need about" in line:
                filler = disk.fill(leave=sum(pages[:3]) + pages[3] // 2)
                break
        stdout, rest = proc.communicate(timeout=300)
        err = "".join(log) + rest
        assert proc.returncode == 2, err
        store = store_root / ref["store_key"]
        assert f"ERROR: {store}: the disk is full (No space left on device) while writing the hidden states " \
               f"of 6 row(s) of shard 0 of 1; the plan expected" in err, err
        assert f"({expected:,} bytes)" in err and "Traceback" not in err
        kept = sorted(p.name for p in store.iterdir())
        assert len(kept) == 3 and all(n.startswith("hs_") for n in kept), kept  # no temp file left
        for name in kept:  # what has a final name is complete, and what an uninterrupted run wrote
            assert file_digest(store / name) == ref["files"][name]
        assert not out.exists()

        filler.unlink()  # space freed: the rerun continues where it stopped
        run_script(*cmd[1:], timeout=300)
        summary = json.loads(out.read_text())
        assert (summary["reused"], summary["regenerated"]) == (3, 3)
        assert summary["files"] == ref["files"]


def _target_with_layers(tmp_path: Path, tiny_target: Path, n: int) -> Path:
    """A target whose config has n layers (layer ids are checked before any weight is read)."""
    out = tmp_path / f"target-{n}"
    out.mkdir()
    config = json.loads((tiny_target / "config.json").read_text())
    config["num_hidden_layers"] = n
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case,layers,settings,expected", [
    ("fewer layers than the aux ids", 4, {"aux_layer_ids": [2, 4, 5]}, "out of range for a target with 4 layers"),
    ("default ids collide", 5, {}, "duplicated layer ids"),
    ("out of order", 8, {"aux_layer_ids": [5, 2, 4]}, "increasing order; use [2, 4, 5]"),
    ("duplicated", 8, {"aux_layer_ids": [2, 2, 5]}, "duplicated layer ids"),
    ("unknown backend", 8, {"backend": "onnx"}, "hidden_states.backend = 'onnx'"),
    ("bad dtype", 8, {"dtype": "int8"}, "hidden_states.dtype"),
])
def test_bad_settings_are_clear_errors(case, layers, settings, expected, workdir, tiny_target, tmp_path):
    target = _target_with_layers(tmp_path, tiny_target, layers) if layers != 8 else tiny_target
    args = extract_args(workdir, tmp_path / "store", tmp_path / "shard.json")
    args[1] = target
    proc = run_script("extract_hidden_states.py", "--settings", json.dumps(settings), *args, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "shard.json").exists() and not (tmp_path / "store").exists()


def test_bad_shard_index(workdir, tmp_path):
    proc = run_script("extract_hidden_states.py", *extract_args(workdir, tmp_path / "s", tmp_path / "o.json", 2, 2),
                      check=False, timeout=120)
    assert proc.returncode == 2 and "--shard 2 is out of range for --num-shards 2" in proc.stderr


def test_weights_changed_after_the_target_stage_are_refused(workdir, tmp_path):
    """The shard hashes the weight files it is about to load (its target_digest is measured,
    not copied from the manifest): weights that no longer match the manifest are refused."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(workdir / RUN / "target" / "model", target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    args = extract_args(workdir, tmp_path / "store", tmp_path / "shard.json")
    args[args.index("--target") + 1] = target
    proc = run_script("extract_hidden_states.py", "--settings", json.dumps({"backend": "transformers"}), *args,
                      check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{target}: its weight files differ from the ones in" in proc.stderr and "rerun the target stage" in proc.stderr
    assert not (tmp_path / "shard.json").exists() and not (tmp_path / "store").exists()


def test_gather_refuses_inconsistent_inputs(pipeline_run, workdir, tmp_path):
    tok = workdir / RUN / "tokenized"
    paths = sorted((pipeline_run / "shards").glob("*-of-2.json"))

    def gather(shards, data=tok / "data"):
        return run_script("gather_hidden_states.py", "--shards", *shards, "--data", data,
                          "--token-freq", tok / "token_freq.pt", "--out-data", tmp_path / "data",
                          "--manifest", tmp_path / "manifest.json", "--provenance", tmp_path / "prov.json",
                          check=False, timeout=120)

    other = json.loads(paths[1].read_text())
    other["target_digest"] = "sha256:another-target"
    (tmp_path / "1-of-2.json").write_text(json.dumps(other))
    proc = gather([paths[0], tmp_path / "1-of-2.json"])
    assert proc.returncode == 2 and "shards disagree on target_digest" in proc.stderr

    proc = gather([paths[0]])
    assert proc.returncode == 2 and "got shards [0] of 2" in proc.stderr

    changed = tmp_path / "changed-data"
    shutil.copytree(tok / "data", changed)
    (changed / "extra.json").write_text("{}")
    proc = gather(paths, data=changed)
    assert proc.returncode == 2 and "changed after hidden states were extracted" in proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "manifest.json").exists()


# --------------------------------------------------------------------------------------
# The transformers backend's pipelined writes (in-process, on the tiny target)
# --------------------------------------------------------------------------------------

PIPE_LENGTHS = [3, 17, 9, 30, 5, 22, 41, 12, 8, 26, 14, 33, 1, 19]


@pytest.fixture(scope="module")
def pipe_rows() -> list[Row]:
    g = torch.Generator().manual_seed(0)
    return [Row(i, torch.randint(10, 2000, (n,), generator=g).tolist()) for i, n in enumerate(PIPE_LENGTHS)]


@pytest.fixture(scope="module")
def tf_backend(tiny_target):
    from pipeline_lib.hidden_states import layer_spec

    spec = layer_spec(tiny_target, {})
    return BACKENDS["transformers"](tiny_target, spec, {"batch_size": 4, "batch_tokens": 96}, max(PIPE_LENGTHS))


def serial_write(backend, batches, store: HSStore) -> None:
    """The pre-pipeline path: forward, a synchronous copy to the host, HSStore.write row by row."""
    for batch in batches:
        host = backend.capture(batch).to("cpu")
        for b, row in enumerate(batch):
            store.write(row, host[b, :len(row.input_ids)].clone())


@pytest.fixture
def slow_commits(monkeypatch):
    """Writers that take a while, so the forward runs ahead and every host buffer gets reused
    while earlier batches are still being written (where a reuse bug would corrupt bytes)."""
    from pipeline_lib.hidden_states import transformers_backend as module

    monkeypatch.setattr(module, "HOST_BUFFERS", 2)
    commit = HSStore.commit

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(HSStore, "commit", slow)


def test_pipelined_writes_same_bytes_as_serial_path(tf_backend, pipe_rows, tmp_path, slow_commits):
    batches = tf_backend.plan(pipe_rows)
    assert len(batches) >= 5 and max(map(len, batches)) == 4  # several multi-row batches, > HOST_BUFFERS
    assert all(len(b) * max(len(r.input_ids) for r in b) <= 96 for b in batches if len(b) > 1)
    serial = HSStore(tmp_path / "serial", tf_backend.spec)
    serial_write(tf_backend, batches, serial)
    piped = HSStore(tmp_path / "piped", tf_backend.spec)
    records = {rec.row: rec for rec in tf_backend.extract(pipe_rows, piped)}
    assert sorted(records) == [r.index for r in pipe_rows]
    for row in pipe_rows:
        data = piped.path(row.index).read_bytes()
        assert data == serial.path(row.index).read_bytes(), f"row {row.index}: bytes differ from the serial path"
        assert records[row.index] == serial.check(row)  # same size, tokens and digest
    assert sorted(os.listdir(piped.root)) == sorted(os.listdir(serial.root))  # no temp file left


def test_pipelined_values_match_unpadded_forward_when_batching_differs(tf_backend, pipe_rows, tmp_path):
    """One row per forward (no padding) vs the planned batches: equal within bf16 tolerance."""
    alone = HSStore(tmp_path / "alone", tf_backend.spec)
    serial_write(tf_backend, [[r] for r in pipe_rows], alone)
    batched = HSStore(tmp_path / "batched", tf_backend.spec)
    list(tf_backend.extract(pipe_rows, batched))
    identical = 0
    for row in pipe_rows:
        a = load_file(batched.path(row.index))["hidden_states"].float()
        b = load_file(alone.path(row.index))["hidden_states"].float()
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        assert rel < TOL_MAX_REL_ERR and cos > TOL_MIN_COSINE, f"row {row.index}: rel {rel:.2e}, cos {cos:.6f}"
        identical += torch.equal(a, b)
    assert identical < len(pipe_rows)  # the batching really differed somewhere


def test_pipelined_writer_error_fails_the_job_and_commits_nothing_invalid(tf_backend, pipe_rows, tmp_path,
                                                                         monkeypatch):
    commit = HSStore.commit

    def disk_full_on_row_9(self, row, temp, **kwargs):
        if row.index == 9:
            raise OSError(28, "No space left on device")
        return commit(self, row, temp, **kwargs)

    monkeypatch.setattr(HSStore, "commit", disk_full_on_row_9)
    store = HSStore(tmp_path / "store", tf_backend.spec)
    with pytest.raises(OSError, match="No space left"):
        list(tf_backend.extract(pipe_rows, store))
    monkeypatch.undo()
    by_index = {r.index: r for r in pipe_rows}
    final = [p for p in store.root.iterdir() if not p.name.startswith(".")]
    assert not store.path(9).exists() and len(final) < len(pipe_rows)
    for path in final:  # whatever got its final name is complete and valid
        assert isinstance(store.check(by_index[int(path.stem[3:])]), FileRecord)
    assert store.clean_temps(range(len(pipe_rows)))  # row 9's temp file is what remains of it
    # The rerun (what extract_hidden_states does) regenerates exactly the missing rows.
    todo = [r for r in pipe_rows if store.check(r) == "missing"]
    assert {rec.row for rec in tf_backend.extract(todo, store)} == {r.index for r in todo}
    assert all(isinstance(store.check(r), FileRecord) for r in pipe_rows)


@pytest.mark.parametrize("where", [(0, 0, 0), (1, 1, 3), (-1, -1, -1)])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_found_anywhere(where, value):
    spec = LayerSpec((1,), 2, 4, "bfloat16")
    hs = torch.randn(3, 2, 4).to(torch.bfloat16)
    hs[where] = value
    from safetensors.torch import save

    data = save({"hidden_states": hs, "token_ids": torch.tensor([5, 6, 7])})
    assert inspect_hs_bytes(data, [5, 6, 7], spec) == "hidden_states has non-finite values"
