"""The speedup a draft buys, measured as a ratio within one job: output tokens/s with and
without the draft, in interleaved rounds on the same prompts (at concurrency 1 and at the
batch), so a change of load on the machine lands in one round, not in the ratio of two jobs.

`run_rounds` warms both arms up (one untimed round), then alternates them (round 1: without,
with; round 2: with, without; ...: a load that drifts steadily then cancels in the mean). `decide` turns the rounds into a figure
or into "not measured" with the reason:

- the interval is Student's t over the per-round ratios (95%): with the few rounds a CPU machine
  can afford (3-5) a bootstrap over rounds cannot be wider than their range and would claim
  too much; t widens with few rounds as it should;
- rounds disagree when their ratios differ by more than `tolerance` of their mean: a load
  change between or inside rounds (interleaving cancels a load that hits both arms of a round;
  one that hits one arm shows here);
- a ratio above the draft's mean acceptance length tau is impossible (a draft emits at most
  tau tokens per target forward and adds work of its own): the timings are wrong.

The two arms' engines are up together (each on 0.45 of the GPU memory) or in turn, one at a time
on all the job's GPUs, for a target spread over more than one GPU: `engines_in_turn`.

EAGLE3_SPEEDUP_TEST_LOAD=<round>:<arm> (tests only) runs busy processes, one per core, while
that arm of that round runs: a real load change the decision must catch."""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from statistics import mean, stdev
from typing import Any, Callable

ARMS = ("without_draft", "with_draft")
SETTINGS = ("batch", "concurrency_1")
TEST_LOAD_ENV = "EAGLE3_SPEEDUP_TEST_LOAD"

# Student's t, two-sided 95% (0.975 quantile) by degrees of freedom; above 30 the normal
# approximation's first Cornish-Fisher term (error < 0.001).
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a t interval needs at least two rounds")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df)


ENGINE_LAYOUTS = ("auto", "together", "in_turn")


def engines_in_turn(setting: str, ranks: int) -> bool:
    """verify.speedup_engines: whether the two engines run one at a time. auto: where the target
    is spread over more than one device (ranks = tensor x pipeline parallel), since two engines
    that each need the whole node cannot be up at once."""
    if setting not in ENGINE_LAYOUTS:
        raise ValueError(f"verify.speedup_engines = {setting!r}: use one of {', '.join(ENGINE_LAYOUTS)}")
    return setting == "in_turn" or (setting == "auto" and ranks > 1)


def decide(rounds: list[dict[str, float]], tau: float | None, tolerance: float) -> dict[str, Any]:
    """rounds: per round {"with_draft": tokens/s, "without_draft": tokens/s}, one setting.
    -> {"speedup": mean ratio or None when not measured, "interval", "ratios", "ratio_mean",
    "spread", "measured", "reason"}."""
    ratios = [r["with_draft"] / r["without_draft"] if r.get("with_draft") and r.get("without_draft") else None
              for r in rounds]
    out: dict[str, Any] = {"ratios": ratios, "ratio_mean": None, "interval": None, "spread": None,
                           "tau_bound": tau, "tolerance": tolerance}
    if len(ratios) < 2 or any(x is None for x in ratios):
        reason = ("fewer than two rounds: no interval" if len(ratios) < 2
                  else "a round decoded no tokens in one of its arms")
        return {**out, "speedup": None, "measured": False, "reason": reason}
    m = mean(ratios)
    half = t975(len(ratios) - 1) * stdev(ratios) / math.sqrt(len(ratios))
    spread = (max(ratios) - min(ratios)) / m
    out.update(ratio_mean=m, interval=[m - half, m + half], spread=spread)
    reasons = []
    if spread > tolerance:
        reasons.append(f"rounds disagree: per-round ratios {', '.join(f'{x:.2f}' for x in ratios)} differ by "
                       f"{spread:.0%} of their mean, more than verify.speedup_tolerance ({tolerance:.0%}), as when "
                       f"the load on the machine changes between rounds")
    if tau is not None and m > tau:
        reasons.append(f"ratio {m:.2f} is above the draft's mean acceptance length {tau:.2f}, which bounds any "
                       f"speedup; the timings are not the draft's")
    return {**out, "speedup": None if reasons else m, "measured": not reasons, "reason": "; ".join(reasons) or None}


@contextlib.contextmanager
def _test_load(round_no: int, arm: str, log: Callable[[str], None]):
    """Busy processes during one arm of one round when EAGLE3_SPEEDUP_TEST_LOAD names it."""
    wanted = os.environ.get(TEST_LOAD_ENV, "")
    if wanted != f"{round_no}:{arm}":
        yield
        return
    log(f"[speedup] {TEST_LOAD_ENV}: busy load during round {round_no}, {arm}")
    # Two per core, each spinning before the arm starts: a strong draft's arm lasts well under a
    # second, less than the busy processes would otherwise take to start.
    spin = "import sys; sys.stdout.write('.'); sys.stdout.flush()\nwhile True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
            for _ in range(2 * (os.cpu_count() or 1))]
    for proc in busy:
        proc.stdout.read(1)
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def run_rounds(arms: dict[str, Callable[[], dict]], rounds: int, log: Callable[[str], None],
               warm_up: bool = True) -> list[dict]:
    """arms: ARMS -> a function that decodes the round's prompts and returns {setting:
    {"output_tokens", "wall_s"}} (a setting it does not measure is absent). Returns one
    {arm: that dict} per round. An untimed round comes first: an engine's first pass over a
    batch shape is slower (seen on a 2-core CPU machine, tiny target, vLLM: 590 vs 1,400 tokens/s at the
    batch, 80 vs 200 at concurrency 1), which would fall on round 1 alone. warm_up=False: arms
    that warm each engine up themselves (engines in turn)."""
    for arm in ARMS if warm_up else ():
        arms[arm]()
    out = []
    for i in range(1, rounds + 1):
        order = ARMS if i % 2 else ARMS[::-1]
        result = {}
        for arm in order:
            with _test_load(i, arm, log):
                result[arm] = arms[arm]()
        log(f"[speedup] round {i}: " + "; ".join(
            f"{arm} " + ", ".join(f"{s} {v['output_tokens'] / v['wall_s']:.1f} tok/s" for s, v in result[arm].items()
                                  if v and v["wall_s"]) for arm in ARMS))
        out.append(result)
    return out


def throughput(rounds: list[dict], taus: dict[str, float | None], tolerance: float,
               prompts: dict[str, int], error: str | None = None) -> dict[str, Any]:
    """acceptance.json "throughput": per setting the summed tokens and seconds of each arm,
    the per-round figures and the decision; the headline at concurrency 1 where measured.
    taus: the bound per setting where the rounds did not count verify steps themselves;
    error: why the rounds did not run (an engine that failed to start)."""
    out: dict[str, Any] = {}
    for setting in SETTINGS:
        if not rounds or any(not r[arm].get(setting) for r in rounds for arm in ARMS):
            out[setting] = None
            continue
        with_draft = [r["with_draft"][setting] for r in rounds]
        drafts = sum(w.get("drafts") or 0 for w in with_draft)
        # The bound: tau on these very prompts where the engine counted its verify steps.
        tau = 1 + sum(w.get("accepted") or 0 for w in with_draft) / drafts if drafts else taus.get(setting)
        per_round = [{arm: r[arm][setting]["output_tokens"] / r[arm][setting]["wall_s"]
                      if r[arm][setting]["wall_s"] else None for arm in ARMS} for r in rounds]
        sides = {arm: {"output_tokens": sum(r[arm][setting]["output_tokens"] for r in rounds),
                       "wall_s": round(sum(r[arm][setting]["wall_s"] for r in rounds), 4)} for arm in ARMS}
        for side in sides.values():
            side["tokens_per_s"] = side["output_tokens"] / side["wall_s"] if side["wall_s"] else None
        out[setting] = {"prompts": prompts[setting], "rounds": per_round, **sides,
                        **decide(per_round, tau, tolerance)}
    headline_at = next((s for s in ("concurrency_1", "batch") if out[s]), None)
    headline = out[headline_at] if headline_at else None
    out.update(speedup=headline["speedup"] if headline else None,
               speedup_interval=headline["interval"] if headline and headline["measured"] else None,
               speedup_measured_at=headline_at,
               speedup_not_measured=(headline["reason"] if headline else "no speedup rounds ran"
                                     + (f" ({error})" if error else "")),
               method=f"{len(rounds)} interleaved rounds in the acceptance job (without / with the draft, the order "
                      f"alternating); speedup = mean of the per-round ratios, 95% Student-t interval over rounds")
    return out
