"""The sizing tables (README's 'Sizing an 8B and a 70B target', docs/sizing.md) are the planner's
own output for the worked configs configs/sizing-8b.yaml and configs/sizing-70b.yaml:
`make docs` writes them (scripts/make_docs.py: sizing_plans) and tests/test_docs.py fails while a
committed page is stale. Here: the real `snakemake -n --configfile <config>` prints the figures
those tables hold, and the GPU-hours follow the target's size."""
from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PY, REPO
from make_docs import SIZING_CONFIGS, sizing_plans

CONFIGS = {"8B": REPO / "configs/sizing-8b.yaml", "70B": REPO / "configs/sizing-70b.yaml"}


def snakemake(config: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "snakemake", *args, "--cores", "1", "-d", str(workdir), "--configfile",
                           str(config)], cwd=REPO, capture_output=True, text=True, timeout=300)


def printed_plan(config: Path, workdir: Path) -> str:
    """The plan `snakemake -n --configfile <config>` prints (stderr), in a scratch directory."""
    proc = snakemake(config, workdir, "-n")
    assert "Plan for run" in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_dry_run_prints_the_plan_the_tables_are_made_from(name, tmp_path):
    from pipeline_lib.plan import format_plan

    assert SIZING_CONFIGS == CONFIGS
    printed = printed_plan(CONFIGS[name], tmp_path).splitlines()
    # Every line but the dtype lines (make_docs passes no CPU verdict) and the plan's free disk.
    expected = [line for line in format_plan(sizing_plans()[name]).splitlines() if "dtype" not in line]
    missing = [line for line in expected if line not in printed]
    assert not missing, f"snakemake -n --configfile {CONFIGS[name]} no longer prints:\n" + "\n".join(missing)


def test_gpu_hours_follow_the_target_size():
    """Same data for both targets, so the same token counts; the target's forward stages cost
    2 x parameters FLOPs a token at 40 % of 989 TFLOP/s, so the 70B's traces and hidden states
    take 70.55 / 8.19 times the 8B's GPU-hours; a measured throughput replaces the estimate."""
    from snakemake.utils import validate

    from pipeline_lib.plan import make_plan

    plans = sizing_plans()
    a, b = plans["8B"], plans["70B"]
    assert a["train_tokens_max"] == b["train_tokens_max"] == 50_000 * min(256 + 2048, 4096)
    for plan, params in ((a, 8_190_735_360), (b, 70_553_706_496)):
        seconds = plan["trace_completion_tokens_max"] * 2 * params / (0.4 * 989e12)
        assert plan["gpu_hours"]["traces"] == pytest.approx(seconds / 3600, abs=1e-3)
        assert plan["gpu_hours"]["verify"] > 0 and plan["gpu_hours"]["forecast"] > 0  # both on in the configs
    assert b["gpu_hours"]["hidden_states"] / a["gpu_hours"]["hidden_states"] == pytest.approx(70.55 / 8.19, rel=1e-2)
    assert b["hidden_state_options"]["offline bf16"]["gpu_hours_total"] > 4 * a["hidden_state_options"]["offline bf16"]["gpu_hours_total"]

    cfg = yaml.safe_load(CONFIGS["8B"].read_text())
    cfg["plan"]["throughput"] = {"generation_tokens_per_s": 2000.0}
    validate(cfg, str(REPO / "schemas/config.schema.yaml"))
    plan = make_plan(cfg, REPO / "results" / "no-such-run")
    assert plan["gpu_hours"]["traces"] == pytest.approx(102_400_000 / 2000 / 3600, abs=1e-3)
    assert plan["gpu_hours"]["hidden_states"] == a["gpu_hours"]["hidden_states"]  # still from the size


def test_gpu_memory_follows_the_code_paths():
    """The planner's GPU memory per stage, from its formulas (pipeline_lib.plan.gpu_memory): the
    8B target in bf16 is 8,030,261,248 x 2 bytes; vLLM traces and hidden states split it over the
    job's GPUs (tensor parallel), the transformers backends and verification do not; training
    holds the draft's fp32 state; online adds the server's share of the target."""
    from snakemake.utils import validate

    from pipeline_lib.plan import format_plan, make_plan

    cfg = yaml.safe_load(CONFIGS["8B"].read_text())
    validate(cfg, str(REPO / "schemas/config.schema.yaml"))
    params, hidden, vocab = 8_190_735_360, 4096, 151_936
    plan = make_plan(cfg, REPO / "results" / "no-such-run")
    mem = {stage: m["bytes_per_gpu"] for stage, m in plan["gpu_memory"].items()}
    draft = plan["variants"]["default"]["draft_parameters"]
    trainable = draft - hidden * vocab - hidden * 32000  # the copies of the target's embedding and lm_head are frozen
    assert mem["traces"] == mem["hidden_states"] == params * 2
    assert mem["train"] == draft * 4 + trainable * 12 + hidden * 32000 * 4
    assert mem["verify"] == 2 * params * 2 + draft * 2  # two engines (target alone, target + draft), one GPU
    cfg["resources"]["verify"]["gpu"] = 2  # tensor parallel 2: the speedup's engines in turn, each split in two
    mem = {stage: m["bytes_per_gpu"] for stage, m in make_plan(cfg, REPO / "results" / "no-such-run")["gpu_memory"].items()}
    assert mem["verify"] == -(-(params * 2 + draft * 2) // 2)
    cfg["verify"]["speedup_engines"] = "together"  # asked: both engines up at once, still split in two
    mem = {stage: m["bytes_per_gpu"] for stage, m in make_plan(cfg, REPO / "results" / "no-such-run")["gpu_memory"].items()}
    assert mem["verify"] == -(-(2 * params * 2 + draft * 2) // 2)
    cfg["resources"]["verify"]["gpu"] = 1
    del cfg["verify"]["speedup_engines"]

    cfg["resources"]["traces"]["gpu"] = 4
    cfg["hidden_states"]["backend"] = "transformers"
    cfg["verify"].update(dtype="float32", backend="transformers")
    plan = make_plan(cfg, REPO / "results" / "no-such-run")
    mem = {stage: m["bytes_per_gpu"] for stage, m in plan["gpu_memory"].items()}
    assert mem["traces"] == params * 2 // 4
    assert mem["hidden_states"] == params * 2  # whole on one GPU
    assert mem["verify"] == params * 4 + draft * 4  # one fp32 target + draft; the load check needs less

    cfg["hidden_states"].update(mode="online", backend="vllm")
    plan = make_plan(cfg, REPO / "results" / "no-such-run")
    assert "hidden_states" not in plan["gpu_memory"]  # no extraction job online
    assert plan["gpu_memory"]["train"]["bytes_per_gpu"] == max(mem["train"], params * 2)  # server on 1 GPU

    del cfg["plan"]["target_shape"]["num_parameters"]
    plan = make_plan(cfg, REPO / "results" / "no-such-run")
    assert plan["gpu_memory"]["traces"]["bytes_per_gpu"] is None
    assert "set plan.target_shape.num_parameters" in format_plan(plan)


# --------------------------------------------------------------------------- what cannot fit
def refused(cfg: dict) -> list[str]:
    from snakemake.utils import validate

    from pipeline_lib.plan import make_plan, refusals

    validate(cfg, str(REPO / "schemas/config.schema.yaml"))
    return refusals(cfg, make_plan(cfg, REPO / "results" / "no-such-run"))


def test_the_plan_refuses_a_70b_target_verification_cannot_hold(tmp_path):
    """The 70B worked config fits its verification: tensor parallel over its 8 GPUs, the
    speedup's engines one at a time, 18 GB of weights a GPU. On one GPU it cannot: its 141 GB
    bf16 target, twice (the speedup's two engines up at once), plus the draft. Snakemake stops
    before any job, with the message and no traceback."""
    cfg = yaml.safe_load(CONFIGS["70B"].read_text())
    assert refused(copy.deepcopy(cfg)) == []
    cfg["resources"]["verify"]["gpu"] = 1
    (message,) = refused(copy.deepcopy(cfg))
    assert message.startswith("verify: 287.6 GB on one GPU (two acceptance engines at once") and "70,553,706,496 parameters" in message
    assert "exceeds the 80 GB of a GPU (plan.gpu_memory_gb) with resources.verify.gpu = 1" in message
    (tmp_path / "70b-verify-on-1.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(tmp_path / "70b-verify-on-1.yaml", tmp_path)
    assert proc.returncode == 1 and "ERROR: the plan refuses this config" in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr and 'File "' not in proc.stderr
    assert not (tmp_path / "results").exists()  # no job ran


def test_the_plan_refuses_weights_a_stage_gpus_cannot_hold():
    """The 70B target (141 GB in bf16) on one 80 GB GPU for its traces: refused, naming the
    stage, the settings and the numbers; on 2 GPUs (70.6 GB each) it fits; on H200s (141 GB,
    plan.gpu_memory_gb) one holds 141.1 GB no more than 80 GB does."""
    cfg = yaml.safe_load(CONFIGS["70B"].read_text())
    cfg["resources"]["traces"]["gpu"] = 1
    (message,) = refused(copy.deepcopy(cfg))
    assert message.startswith("traces: 141.1 GB on one GPU (target bfloat16, tensor parallel over 1 GPU(s)")
    assert "exceeds the 80 GB of a GPU (plan.gpu_memory_gb) with resources.traces.gpu = 1" in message
    cfg["resources"]["traces"]["gpu"] = 2
    assert refused(copy.deepcopy(cfg)) == []
    cfg["resources"]["traces"]["gpu"] = 1
    cfg["plan"]["gpu_memory_gb"] = 141
    assert [m.split(":")[0] for m in refused(copy.deepcopy(cfg))] == ["traces"]  # 141.1 GB > 141 GB
    cfg["plan"]["gpu_memory_gb"] = 142
    assert refused(cfg) == []


def test_the_plan_refuses_a_job_larger_than_a_node():
    """A job's GPUs beyond plan.gpus_per_node: refused for a one-node stage; training may span
    resources.train.nodes, so 16 GPUs on 2 nodes of 8 fit and on one do not."""
    cfg = yaml.safe_load(CONFIGS["8B"].read_text())
    cfg["plan"]["gpus_per_node"] = 8
    cfg["resources"]["hidden_states"]["gpu"] = 16
    cfg["resources"]["train"]["gpu"] = 16
    assert refused(copy.deepcopy(cfg)) == [
        "hidden_states: resources.hidden_states.gpu = 16 needs 16 GPUs on one node, but a node has 8 "
        "(plan.gpus_per_node): give the stage at most 8 GPUs",
        "train: resources.train.gpu = 16 needs 16 GPUs on one node, but a node has 8 (plan.gpus_per_node): "
        "give the stage at most 8 or raise resources.train.nodes"]
    cfg["resources"]["hidden_states"]["gpu"] = 8
    cfg["resources"]["train"]["nodes"] = 2
    assert refused(cfg) == []


def test_the_parameter_count_comes_from_a_local_targets_safetensors(tiny_target):
    """Without plan.target_shape.num_parameters, a local target's count is read from its
    safetensors headers (no weights loaded): what the materialized manifest would record."""
    from safetensors.torch import load_file

    from pipeline_lib.plan import target_shape

    shape = target_shape({"target": {"source": "local", "path": str(tiny_target)}}, REPO / "results" / "no-such-run")
    weights = load_file(tiny_target / "model.safetensors")
    assert shape["num_parameters"] == sum(t.numel() for t in weights.values()) > 0
