"""From forecast points to what a user decides on: the speedup at each acceptance length tau and
requests in flight, the break-even tau per concurrency, and a measured tau placed on the curve.

The speedup is output tok/s with the draft over without it at the same number of closed-loop
streams. With a fixed number of streams each stream gets its share of the output, so this is
also the per-user gain (what bench/speedup_curve.py reports from inter-token latency), and it
needs no streamed text: a dummy-weight target emits token ids its tokenizer may not have, whose
text is empty, and GuideLLM then has no chunks to time. The per-user tok/s are kept beside it. The x axis is the tau the server counted at the point (its own counters), which for
synthetic acceptance is the tau asked for within sampling noise."""
from __future__ import annotations

from typing import Iterable

NO_DRAFT = "no draft"


def point_key(p: dict) -> tuple:
    """What a draft point is compared on with its no-draft point: the same requests in flight,
    load (natural or fixed-length answers) and weights (real or dummy). Records written before
    loads and weights were named have neither: one load, one kind of weights."""
    return p["streams"], p.get("load"), p.get("weights")


def speedup_rows(points: Iterable[dict], default_k: int | None = None) -> list[dict]:
    """One row per draft point that has a measured no-draft point at the same streams, load
    and weights. Each row carries the point's k (points written before the forecast measured
    several ks have none: default_k, the record's num_speculative_tokens)."""
    points = [p for p in points if not p.get("not_measured")]
    base = {point_key(p): p for p in points if p["arm"] == NO_DRAFT}
    rows = []
    for p in points:
        if p["arm"] == NO_DRAFT or point_key(p) not in base:
            continue
        b = base[point_key(p)]
        tau = p.get("tau") or p.get("tau_set")
        rows.append({"arm": p["arm"], "k": p.get("k", default_k), "load": p.get("load"), "weights": p.get("weights"),
                     "streams": p["streams"], "tau_set": p.get("tau_set"), "tau": tau,
                     "speedup": p["output_tok_s"] / b["output_tok_s"],
                     "per_user_ratio": p["tok_s_per_user"] / b["tok_s_per_user"],
                     "tok_s_per_user": p["tok_s_per_user"], "no_draft_tok_s_per_user": b["tok_s_per_user"]})
    return sorted(rows, key=lambda r: (r["streams"], r["tau"] or 0))


def _series(rows: list[dict], streams: int, k: int | None = None) -> list[tuple[float, float]]:
    """(tau, speedup) at `streams`; of one k where k is given (a curve is one k's)."""
    return sorted((r["tau"], r["speedup"]) for r in rows
                  if r["streams"] == streams and r["tau"] and (k is None or r.get("k") == k))


def break_even(rows: list[dict], streams: int, k: int | None = None) -> dict:
    """The tau at which the draft starts to pay at `streams` requests in flight: linear between the
    two measured taus around speedup 1. {"tau", "bound"}: bound "at" (interpolated), "above"
    (every measured point below 1: break-even beyond the largest tau measured, or never), "below"
    (every point at or above 1: it pays from the smallest tau measured), or "none" (no points)."""
    s = _series(rows, streams, k)
    if not s:
        return {"tau": None, "bound": "none"}
    if s[0][1] >= 1.0:
        return {"tau": s[0][0], "bound": "below"}
    for (t0, y0), (t1, y1) in zip(s, s[1:]):
        if y0 < 1.0 <= y1:
            return {"tau": t0 + (1.0 - y0) * (t1 - t0) / (y1 - y0), "bound": "at"}
    return {"tau": s[-1][0], "bound": "above"}


def speedup_at(rows: list[dict], streams: int, tau: float, k: int | None = None) -> float | None:
    """The forecast speedup at a measured tau: linear between the measured taus around it; None
    outside the measured range (a forecast does not extrapolate)."""
    s = _series(rows, streams, k)
    for (t0, y0), (t1, y1) in zip(s, s[1:]):
        if t0 <= tau <= t1:
            return y0 + (tau - t0) * (y1 - y0) / (t1 - t0) if t1 > t0 else (y0 + y1) / 2
    if len(s) == 1 and abs(s[0][0] - tau) < 0.05:
        return s[0][1]
    return None


def break_even_text(be: dict) -> str:
    if be["bound"] == "at":
        return f"{be['tau']:.2f}"
    if be["bound"] == "above":
        return f"> {be['tau']:.2f} (slower at every tau measured)"
    if be["bound"] == "below":
        return f"<= {be['tau']:.2f} (pays at every tau measured)"
    return "not measured"


def summary(points: list[dict], streams: list[int], ks: list[int] | None = None,
            default_k: int | None = None) -> dict:
    """Rows and the break-even per concurrency (at default_k, verify's k, where given), for the
    JSON record and the plan; with several ks also the break-even per k."""
    rows = speedup_rows(points, default_k)
    out = {"rows": rows, "break_even": {str(n): break_even(rows, n, default_k) for n in streams}}
    if ks and len(ks) > 1:
        out["break_even_by_k"] = {str(k): {str(n): break_even(rows, n, k) for n in streams} for k in ks}
    return out


def table_md(points: list[dict], streams: list[int], k: int | None = None, default_k: int | None = None) -> str:
    """Speedup per tau and concurrency, then the break-even tau per concurrency (one k's where
    k is given)."""
    rows = [r for r in speedup_rows(points, default_k) if k is None or r["k"] == k]
    taus = sorted({(r["tau_set"], round(r["tau"], 2)) for r in rows}, key=lambda t: t[1])
    by = {(r["tau_set"], round(r["tau"], 2), r["streams"]): r for r in rows}
    # one column per tau asked for; the tau counted may differ a little per concurrency
    cols = sorted({t for t, _ in taus if t is not None}) or sorted({t for _, t in taus})
    synthetic = any(t is not None for t, _ in taus)
    head = "| requests in flight | no draft, tok/s per user | " + " | ".join(
        f"tau {c:.2f}" for c in cols) + " | break-even tau |"
    lines = [head, "|" + "---|" * (len(cols) + 3)]
    base = {p["streams"]: p for p in points if p["arm"] == NO_DRAFT and not p.get("not_measured")}
    for n in streams:
        cells = []
        for c in cols:
            r = next((v for (ts, t, s), v in by.items() if s == n and ((ts == c) if synthetic else (t == c))), None)
            cells.append(f"{r['speedup']:.2f}" if r else "-")
        b = base.get(n)
        lines.append(f"| {n} | {b['tok_s_per_user']:,.1f} | " if b else f"| {n} | not measured | ")
        lines[-1] += " | ".join(cells) + f" | {break_even_text(break_even(rows, n, k))} |"
    return "\n".join(lines) + "\n"


def plot(points: list[dict], streams: list[int], out, title: str, ks: list[int] | None = None,
         default_k: int | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = speedup_rows(points, default_k)
    several = ks is not None and len(ks) > 1
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for k in (ks if several else [None]):
        for n in streams:
            s = _series(rows, n, k)
            if s:
                ax.plot([t for t, _ in s], [y for _, y in s], "o-",
                        label=f"k {k}, {n} in flight" if several else f"{n} in flight")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("acceptance length tau (server-counted)")
    ax.set_ylabel("speedup (output tok/s with draft / without)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def forecast_ks(forecast: dict) -> list[int]:
    """The ks a forecast record measured: forecast.speculative_token_counts, or (records from
    before that setting, and its default) verify's k alone."""
    settings = forecast.get("settings") or {}
    return settings.get("speculative_token_counts") or [settings.get("num_speculative_tokens")]


def tau_at_k(rates: list[float], k: int) -> float | None:
    """The acceptance length a draft reaches drafting k tokens: 1 + the first k per-position
    rates. The acceptance job's rates are unconditional (steps that accepted position i over all
    steps, acceptance/records.py), and a chain draft's first k positions do not depend on how many
    come after, so this holds for any k up to the k the job drafted; beyond it nothing was counted."""
    return 1.0 + sum(rates[:k]) if rates and k <= len(rates) else None


def _record_rows(forecast: dict) -> list[dict]:
    """A record's speedup rows, each with its k (rows of older records have none: verify's k)."""
    default_k = (forecast.get("settings") or {}).get("num_speculative_tokens")
    rows = forecast.get("rows") or speedup_rows(forecast.get("points") or [], default_k)
    return [{**r, "k": r.get("k", default_k)} for r in rows]


def placements_by_k(forecast: dict, acceptance: dict) -> dict[str, dict[str, dict]]:
    """Each forecast k's speedup per concurrency at the tau the trained draft reaches at that k
    (tau_at_k): {k: {streams: {"tau", "speedup", "reason"}}}; speedup None (with the reason) where
    the tau lies outside the taus that k's curve measured (no extrapolation) or was not counted."""
    rates = ((acceptance.get("acceptance") or {}).get("trained") or {}).get("acceptance_rate_per_position") or []
    rows = _record_rows(forecast)
    out = {}
    for k in forecast_ks(forecast):
        tau = tau_at_k(rates, k)
        out[str(k)] = {}
        for n in sorted({r["streams"] for r in rows}):
            at = speedup_at(rows, n, tau, k) if tau is not None else None
            taus = [r["tau"] for r in rows if r["streams"] == n and r["k"] == k and r["tau"]]
            reason = (None if at is not None else
                      f"the acceptance job drafted {len(rates)} token(s): no acceptance counted at position {k}"
                      if tau is None and rates else "no per-position acceptance measured" if tau is None
                      else f"no forecast points at k {k}" if not taus
                      else f"tau {tau:.2f} lies outside the taus measured at k {k} ({min(taus):.2f}-{max(taus):.2f})")
            out[str(k)][str(n)] = {"tau": tau, "speedup": at, "reason": reason}
    return out


def placement(forecast: dict, acceptance: dict) -> dict:
    """The measured draft on the forecast curve: the forecast speedup at the tau the acceptance
    job measured (all eval prompts), at one request in flight, beside the speedup that job
    measured at concurrency 1. Each figure is None where it does not exist, with the reason."""
    trained = ((acceptance.get("acceptance") or {}).get("trained") or {})
    tau = trained.get("mean_acceptance_length")
    c1 = ((acceptance.get("throughput") or {}).get("concurrency_1") or {})
    k = (forecast.get("settings") or {}).get("num_speculative_tokens")
    rows = [r for r in _record_rows(forecast) if r["k"] == k]  # the curve at the k the draft was verified with
    streams = min((r["streams"] for r in rows), default=None)
    at = speedup_at(rows, streams, tau) if tau is not None and streams is not None else None
    out = {"tau": tau, "streams": streams, "forecast_speedup": at, "measured_speedup": c1.get("speedup"),
           "measured_reason": c1.get("reason"), "is_forecast": bool(forecast.get("is_forecast")),
           "note": forecast.get("note"), "break_even": (forecast.get("break_even") or {}).get(str(streams)),
           "accelerator": (forecast.get("accelerator") or {}).get("model")}
    out["by_k"] = placements_by_k(forecast, acceptance)
    if at is not None and out["measured_speedup"]:
        out["measured_over_forecast"] = out["measured_speedup"] / at
    elif at is None:
        taus = [r["tau"] for r in rows if r["streams"] == streams]
        out["forecast_reason"] = (f"tau {tau:.2f} lies outside the taus the forecast measured "
                                  f"({min(taus):.2f}-{max(taus):.2f})" if tau is not None and taus
                                  else "no forecast points" if not taus else "no tau measured")
    return out
