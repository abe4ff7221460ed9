"""One arm of a forecast or of its check: a `vllm serve` (the target alone, or with a draft at its
own or at a synthetic acceptance) measured by GuideLLM under one or more loads, each at several
requests in flight. Shared by the forecast stage (scripts/forecast_speedup.py) and the check of
the forecast against a trained draft (bench/forecast_check.py), so both measure alike."""
from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..io import atomic_write_json
from . import curve, load, shapes
from .server import Server, scrape

TAU_TOLERANCE = 0.15  # the tau counted at a synthetic point may differ from the one asked by sampling noise

# GuideLLM's data per load: "natural" answers end where the target stops (EOS or max_tokens);
# "fixed" answers run to max_tokens (ignore_eos), so every arm decodes the same number of tokens
# whatever its weights (dummy weights rarely emit EOS, real ones usually do).
NATURAL, FIXED = "natural", "fixed"


@dataclass
class Arm:
    arm: str                              # curve.NO_DRAFT, or the draft arm's name
    tag: str                              # its files: server-<tag>.log, guidellm-<tag>-...
    speculative_config: dict | None = None
    k: int | None = None                  # num_speculative_tokens of its speculative_config
    tau_set: float | None = None          # synthetic mean acceptance length asked for
    rates_set: list[float] | None = None  # or synthetic per-position (unconditional) rates
    load_format: str | None = None        # "dummy": random weights, no weights read
    loads: list[tuple[str, list[int]]] = field(default_factory=list)  # (load, streams) in turn

    def server_config(self) -> dict | None:
        """vLLM's speculative_config with the synthetic sampler where a tau or rates is set."""
        if self.speculative_config is None:
            return None
        if self.rates_set is not None:
            return {**self.speculative_config, "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": list(self.rates_set)}
        if self.tau_set is not None:
            return {**self.speculative_config, "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_length": self.tau_set}
        return self.speculative_config

    def expected_tau(self) -> float | None:
        if self.tau_set is not None:
            return self.tau_set
        if self.rates_set is not None:
            return 1.0 + sum(self.rates_set)
        return None


def synthetic_schedule(tau: float, k: int) -> list[float]:
    """The per-position (unconditional) rates vLLM makes of a scalar synthetic acceptance length:
    its minimum-variance schedule (vLLM 0.26, SpeculativeConfig._acceptance_length_to_rates): the
    first floor(tau - 1) positions always accepted, one partly, the rest never."""
    accepted = tau - 1.0
    full = int(accepted)
    return ([1.0] * full + [accepted - full] + [0.0] * k)[:k]


def geometric_rates(tau: float, k: int) -> list[float]:
    """Per-position (unconditional) rates for a mean acceptance length tau when every position is
    accepted with the same probability a given the ones before it: rate i = a^(i+1), with
    1 + a + ... + a^k = tau. How a trained draft accepts: on an H100 (2026-12-07) the demo's draft
    counted [0.278, 0.067, 0.020] at tau 1.36, a = 0.28 gives [0.28, 0.078, 0.022]; vLLM's scalar
    schedule gives [0.36, 0, 0] and forecast 4-12% too fast at 16 and 64 in flight
    (bench/results/forecast-check-h100-2026-12-07)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau {tau} outside 1..k + 1 = {k + 1}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the sum grows with a
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(1, k + 1)) < tau - 1 else (lo, a)
    a = (lo + hi) / 2
    return [round(a ** i, 6) for i in range(1, k + 1)]


# forecast.acceptance_profile: how a tau becomes what vLLM's synthetic sampler accepts per position
ACCEPTANCE_PROFILES = ("geometric", "scalar")


def synthetic_rates(tau: float, k: int, profile: str) -> list[float] | None:
    """The rates to ask vLLM for at tau (None: vLLM's own scalar schedule from tau alone)."""
    if profile not in ACCEPTANCE_PROFILES:
        raise ValueError(f"acceptance profile {profile!r}; known: {', '.join(ACCEPTANCE_PROFILES)}")
    return geometric_rates(tau, k) if profile == "geometric" else None


def draft_dir(s: dict, target: Path, work: Path, with_weights: bool, name: str = "draft") -> Path:
    """The run's draft as vLLM will load it: config only (dummy weights), or with random
    weights where the target loads its real ones (vLLM loads the draft like the target)."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    shapes.write_draft_config(target, out, s["draft_type"], s["draft_layers"], s["draft_vocab_size"],
                              s["num_speculative_tokens"], s["aux_layer_ids"])
    if with_weights:
        shapes.write_random_draft_weights(out)
    return out


def measure_arm(arm: Arm, server_args: dict, s: dict, data: dict[str, Path], tokenizer: Path, work: Path,
                record: dict, log_prefix: str = "[forecast]") -> None:
    """Start the arm's server, measure each (load, streams) point, append the points to
    record["points"] (a failed point with its reason) and the arm to record["arms"]; the record
    is written to work/partial.json after every point, so a stopped run keeps what it measured."""
    t = time.time()
    every = [(name, n) for name, streams in arm.loads for n in streams]
    base = {"arm": arm.arm, "tag": arm.tag, "weights": "dummy" if arm.load_format == "dummy" else "real",
            "tau_set": arm.expected_tau()}
    if arm.k is not None:
        base["k"] = arm.k
    if arm.rates_set is not None:
        base["rates_set"] = list(arm.rates_set)
    try:
        with Server(log=work / f"server-{arm.tag}.log", speculative_config=arm.server_config(),
                    load_format=arm.load_format, **server_args) as server:
            record["arms"].append({**base, "start_s": round(server.start_s, 1)})
            print(f"{log_prefix} {arm.tag}: server up in {server.start_s:.0f} s", flush=True)
            for name, n in every:
                p = {**base, "load": name, "streams": n}
                before = scrape(server.url)
                try:
                    stem = f"{arm.tag}-{n}" if name == NATURAL else f"{arm.tag}-{name}-{n}"
                    bench = load.guidellm_point(server.url, n, data[name], tokenizer, s["max_tokens"], s["seconds"],
                                                s["warmup"], work / f"guidellm-{stem}.json", work / f"guidellm-{arm.tag}.log")
                    p.update(load.point_figures(bench, before, scrape(server.url)))
                    if not p["tok_s_per_user"] and p["output_tok_s"]:
                        # Dummy weights emit token ids the tokenizer may not have: their text is empty,
                        # GuideLLM sees no chunks to time. Closed loop: each stream gets 1/n of the output.
                        p["tok_s_per_user"], p["tok_s_per_user_from"] = p["output_tok_s"] / n, "output tok/s / streams"
                    p["not_measured"] = load.check_point(p, s["min_requests"])
                    want = arm.expected_tau()
                    if not p["not_measured"] and want is not None and p["tau"] is not None \
                            and abs(p["tau"] - want) > TAU_TOLERANCE:
                        p["not_measured"] = (f"the server counted tau {p['tau']:.2f} for a synthetic tau of "
                                             f"{want:.2f}: the synthetic sampler did not run as asked")
                except (RuntimeError, OSError) as err:  # GuideLLM failed, or the server died mid-point
                    p["not_measured"] = f"{err}" + (f"; server log: {server.log}" if server.proc.poll() is not None else "")
                record["points"].append(p)
                atomic_write_json(work / "partial.json", record)  # what a stopped run still has
                print(f"{log_prefix} {arm.tag} {name} @{n}: " + (p["not_measured"] or
                      f"{p['output_tok_s']:,.0f} tok/s, {p['tok_s_per_user']:,.1f} tok/s/user, tau {p['tau']}"), flush=True)
    except RuntimeError as err:
        # An arm whose server does not start is a finding (the engine refused the draft), kept as such.
        record["arms"].append({**base, "error": str(err)[-2000:], "wall_s": round(time.time() - t, 1)})
        for name, n in every:
            record["points"].append({**base, "load": name, "streams": n,
                                     "not_measured": f"the server did not start: {str(err).splitlines()[0]}"})
        atomic_write_json(work / "partial.json", record)
        print(f"{log_prefix} {arm.tag}: server failed: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)


def flag_impossible(points: list[dict]) -> None:
    """A speedup above the tau counted (5% margin) is impossible for a draft: each verify step
    emits at most the accepted tokens plus one. Such a point is not measured. The speedup is the
    one reported (curve.speedup_rows: output tok/s with / without the draft at the same streams),
    not the per-user figure from inter-token latency, which leaves out the time to first token:
    on a CPU with 12-token answers that figure put a random draft (tau 1.00) at 1.13x while its
    output tok/s was half the target's alone (2026-12-06, CI)."""
    base = {curve.point_key(p): p for p in points if p["arm"] == curve.NO_DRAFT and not p.get("not_measured")}
    for p in points:
        b = base.get(curve.point_key(p))
        if p["arm"] == curve.NO_DRAFT or p.get("not_measured") or not b or not p.get("tau") \
                or not b.get("output_tok_s"):
            continue
        gain = p["output_tok_s"] / b["output_tok_s"]
        if gain > p["tau"] * 1.05:
            p["not_measured"] = (f"speedup {gain:.2f} (output tok/s with / without the draft) above the acceptance "
                                 f"length {p['tau']:.2f}: the arms did not run alike")
