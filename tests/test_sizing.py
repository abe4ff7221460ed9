"""The sizing tables (README's 'Sizing an 8B and a 70B target', docs/sizing.md) are the planner's
own output for configs/sizing-8b.yaml and configs/sizing-70b.yaml: each config is planned with
the real `snakemake -n`, the figures are read from what it prints, and every table row built
from them must be a line of the page. A hand-edited figure, or a planner or config change that
moves one, fails here with the rows the page should have."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PY, REPO

CONFIGS = {"8B": REPO / "configs/sizing-8b.yaml", "70B": REPO / "configs/sizing-70b.yaml"}
STAGES = ("traces", "hidden_states", "train", "verify")


def printed_plan(config: Path, workdir: Path) -> str:
    """The plan `snakemake -n --configfile <config>` prints (stderr), in a scratch directory."""
    proc = subprocess.run([PY, "-m", "snakemake", "-n", "--cores", "1", "-d", str(workdir), "--configfile",
                           str(config)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Plan for run" in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def one(pattern: str, text: str) -> re.Match:
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"the plan no longer prints {pattern!r}:\n{text[:4000]}"
    return m


def figures(text: str) -> dict[str, str]:
    """The printed figures the tables quote, as printed."""
    f = {}
    m = one(r"traces: (\d+) prompts, <= ([\d,]+) generated tokens", text)
    f["prompts"], f["generated"] = f"{int(m[1]):,}", m[2]
    f["train_tokens"] = one(r"hidden states: <= ([\d,]+) tokens x", text)[1]
    m = one(r"hidden states by storage: bf16 (\S+ \S+) \((\S+ \S+)/token\), fp8 (\S+ \S+) \((\S+ \S+)/token\)", text)
    f["bf16"], f["bf16_token"], f["fp8"], f["fp8_token"] = m[1], m[2], m[3], m[4]
    for name in ("offline bf16", "offline fp8", "online"):
        m = one(rf"^\s+{name}\s+(\S+ \S+) /\s+([\d.]+) GPU-h", text)
        f[f"disk {name}"], f[f"gpu_h {name}"] = m[1], m[2]
    m = one(r"draft 'default': ([\d,]+) params, checkpoints (\S+ \S+), (\d+) epochs", text)
    f["draft_params"], f["checkpoints"], f["epochs"] = m[1], m[2], m[3]
    m = one(r"GPU-hours: traces ([\d.]+), hidden states ([\d.]+), training ([\d.]+)", text)
    f["gpu_h traces"], f["gpu_h hidden_states"], f["gpu_h train"] = m[1], m[2], m[3]
    for stage in STAGES:
        f[f"mem {stage}"] = one(rf"^\s+{stage}\s+(\S+ \S+)  \(", text)[1]
    return f


def gpus(config: Path) -> dict[str, int]:
    res = yaml.safe_load(config.read_text())["resources"]
    return {stage: res[stage]["gpu"] for stage in STAGES}


def per_job(n: int) -> str:
    return f"{n} GPU a job" if n == 1 else f"{n} GPUs a job"


def readme_rows(f: dict[str, dict[str, str]], g: dict[str, dict[str, int]]) -> list[str]:
    a, b = f["8B"], f["70B"]
    ga, gb = g["8B"], g["70B"]
    return [
        f"| traces: GPU memory per GPU; GPU-hours | {a['mem traces']} ({per_job(ga['traces'])}); {a['gpu_h traces']} "
        f"| {b['mem traces']} ({per_job(gb['traces'])}); {b['gpu_h traces']} |",
        f"| hidden states: disk in bf16 / fp8 | {a['bf16']} / {a['fp8']} | {b['bf16']} / {b['fp8']} |",
        f"| hidden states: GPU memory per GPU; GPU-hours | {a['mem hidden_states']} ({per_job(ga['hidden_states'])}); "
        f"{a['gpu_h hidden_states']} | {b['mem hidden_states']} ({per_job(gb['hidden_states'])}); "
        f"{b['gpu_h hidden_states']} |",
        f"| training: GPU memory per GPU; GPU-hours | {a['mem train']} ({per_job(ga['train'])}); {a['gpu_h train']} "
        f"| {b['mem train']} ({per_job(gb['train'])}); {b['gpu_h train']} |",
        f"| verification: GPU memory on its one GPU | {a['mem verify']} | {b['mem verify']} |",
    ]


def sizing_rows(f: dict[str, dict[str, str]], g: dict[str, dict[str, int]]) -> list[str]:
    a, b = f["8B"], f["70B"]
    ga, gb = g["8B"], g["70B"]

    def row(label: str, key: str) -> str:
        return f"| {label} | {a[key]} | {b[key]} |"

    return [
        f"| training conversations; generated tokens (at most) | {a['prompts']}; {a['generated']} "
        f"| {b['prompts']}; {b['generated']} |",
        row("training tokens (at most)", "train_tokens"),
        f"| hidden states per token, bf16 / fp8 | {a['bf16_token']} / {a['fp8_token']} "
        f"| {b['bf16_token']} / {b['fp8_token']} |",
        f"| hidden states on disk, bf16 / fp8 | {a['bf16']} / {a['fp8']} | {b['bf16']} / {b['fp8']} |",
        f"| disk to plan for (2x the hidden states + checkpoints): offline bf16 / offline fp8 / online "
        f"| {a['disk offline bf16']} / {a['disk offline fp8']} / {a['disk online']} "
        f"| {b['disk offline bf16']} / {b['disk offline fp8']} / {b['disk online']} |",
        f"| draft parameters; checkpoints | {a['draft_params']}; {a['checkpoints']} "
        f"| {b['draft_params']}; {b['checkpoints']} |",
        *(f"| GPU memory per GPU: {label} | {a['mem ' + stage]} ({per_job(ga[stage])}) "
          f"| {b['mem ' + stage]} ({per_job(gb[stage])}) |"
          for stage, label in (("traces", "traces"), ("hidden_states", "hidden states"), ("train", "training"))),
        row("GPU memory: verification, on one GPU", "mem verify"),
        f"| GPU-hours: traces / hidden states / training ({a['epochs']} epochs) "
        f"| {a['gpu_h traces']} / {a['gpu_h hidden_states']} / {a['gpu_h train']} "
        f"| {b['gpu_h traces']} / {b['gpu_h hidden_states']} / {b['gpu_h train']} |",
        f"| GPU-hours in all: offline (bf16 or fp8) / online | {a['gpu_h offline bf16']} / {a['gpu_h online']} "
        f"| {b['gpu_h offline bf16']} / {b['gpu_h online']} |",
    ]


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[dict, dict]:
    f = {name: figures(printed_plan(path, tmp_path_factory.mktemp(f"plan-{name}"))) for name, path in CONFIGS.items()}
    return f, {name: gpus(path) for name, path in CONFIGS.items()}


@pytest.mark.parametrize("page, rows", [("README.md", readme_rows), ("docs/sizing.md", sizing_rows)])
def test_sizing_tables_are_the_planners_output(planned, page, rows):
    lines = set((REPO / page).read_text().splitlines())
    expected = rows(*planned)
    missing = [r for r in expected if r not in lines]
    assert not missing, (f"{page}: these rows of the sizing table differ from what the planner prints for "
                         f"configs/sizing-*.yaml (rows as they should read):\n" + "\n".join(missing))


def test_the_sizing_configs_plan_what_their_tables_say(planned):
    """The figures follow the configs' own settings: the same data for both targets, so the
    same token counts; the 70B target's hidden states twice the 8B's per token (hidden size
    8192 vs 4096); fp8 about half of bf16."""
    f, _ = planned
    assert f["8B"]["train_tokens"] == f["70B"]["train_tokens"] == "115,200,000"  # 50,000 x min(256 + 2,048, 4,096)
    assert f["8B"]["bf16_token"] == "32.8 KB" and f["70B"]["bf16_token"] == "65.5 KB"  # 4 layers x H x 2 bytes
    assert f["8B"]["fp8_token"] == "16.4 KB" and f["70B"]["fp8_token"] == "32.8 KB"


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
