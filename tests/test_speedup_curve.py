"""bench/speedup_curve.py: the figures it reads from GuideLLM and from vLLM's /metrics, and the
checks that keep a point that lies out of the table. The record is a real one (the H200 run of
2026-12-05, target alone, one request in flight), trimmed to the fields the bench reads. The whole
flow (two `vllm serve` arms, GuideLLM per point) runs with BENCH_SMOKE=1 on CPU: see
docs/gpus-and-clusters.md."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import speedup_curve as sc  # noqa: E402
from pipeline_lib.forecast import server as server_mod  # noqa: E402

RECORD = json.loads((Path(__file__).parent / "data/guidellm-h200-nodraft-1.json").read_text())["benchmarks"][0]
METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 900.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 350.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 200.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 110.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 40.0
vllm:generation_tokens_total{engine="0",model_name="target"} 1234.0
"""


def counters(drafts: float, accepted: float) -> dict:
    return {"vllm:spec_decode_num_drafts_total": drafts, "vllm:spec_decode_num_accepted_tokens_total": accepted,
            "vllm:spec_decode_num_draft_tokens_total": 3 * drafts}


def test_figures_of_a_real_guidellm_record():
    p = sc.point_figures(RECORD, counters(100, 50), counters(300, 350))
    assert p["requests_ok"] == 27 and p["requests_errored"] == 0
    assert p["output_tok_s"] == pytest.approx(468, abs=1)
    assert p["tok_s_per_user"] == pytest.approx(1000 / p["itl_ms"]) == pytest.approx(502.1, abs=0.1)
    assert p["tau"] == pytest.approx(1 + 300 / 200)  # the counters' deltas, not their totals
    assert sc.point_figures(RECORD, counters(0, 0), counters(0, 0))["tau"] is None  # no draft: no tau
    assert sc.check_point(p, min_requests=8) is None


def test_a_point_with_failed_or_too_few_requests_is_not_measured():
    p = sc.point_figures(RECORD, counters(0, 0), counters(0, 0))
    assert "27 requests completed" in sc.check_point(p, min_requests=40)
    assert "2 requests failed" in sc.check_point({**p, "requests_errored": 2}, min_requests=8)


def test_the_metrics_scrape_sums_the_spec_decode_counters(monkeypatch):
    class Response:
        def read(self):
            return METRICS.encode()

    monkeypatch.setattr(server_mod.urllib.request, "urlopen", lambda url, timeout: Response())
    got = sc.scrape("http://127.0.0.1:1")
    assert got == {"vllm:spec_decode_num_drafts_total": 300.0, "vllm:spec_decode_num_accepted_tokens_total": 350.0,
                   "vllm:spec_decode_num_draft_tokens_total": 900.0,
                   "vllm:spec_decode_num_accepted_tokens_per_pos_total": {0: 200.0, 1: 110.0, 2: 40.0}}
    # per position, the deltas over the drafts: vLLM's synthetic_acceptance_rates of the window
    before = {**counters(100, 50), server_mod.PER_POSITION: {0: 40.0, 1: 10.0, 2: 0.0}}
    rates = sc.point_figures(RECORD, before, got)["acceptance_rates"]
    assert rates == pytest.approx([160 / 200, 100 / 200, 40 / 200])
    assert sum(rates) + 1 == pytest.approx(sc.point_figures(RECORD, before, got)["tau"])


def test_a_gain_above_the_acceptance_length_is_flagged_not_reported():
    base = sc.point_figures(RECORD, counters(0, 0), counters(0, 0))
    honest = {**base, "arm": "draft", "streams": 1, "tok_s_per_user": base["tok_s_per_user"] * 1.8, "tau": 2.0,
              "not_measured": None}
    points = [{**base, "arm": "no draft", "streams": 1, "not_measured": None}, honest]
    g = sc.gain_at_one(points, 1)
    assert g["gain"] == pytest.approx(1.8) and g["gain_over_tau"] == pytest.approx(0.9)
    assert honest["not_measured"] is None
    lying = {**honest, "tok_s_per_user": base["tok_s_per_user"] * 4.9}  # like the 4.89x of a changed load
    points[1] = lying
    sc.gain_at_one(points, 1)
    assert "above the acceptance length" in lying["not_measured"]
    assert "not measured" in sc.table(points, [1])
