"""The measured draft placed on the run's speedup forecast (rules/forecast.smk): the forecast's
speedup at the tau this draft measured, beside the speedup measured at concurrency 1, and the
break-even tau. Only when the run has a forecast (forecast.enabled)."""
from __future__ import annotations

import json

from ..forecast import schedule
from ..forecast.curve import break_even_text
from ..render import Section, Table, fmt


def sections(result: dict) -> list[Section]:
    f = result.get("forecast")
    if not f:
        return []
    tau = "not measured" if f["tau"] is None else f"{f['tau']:.2f}"
    forecast = (f"{f['forecast_speedup']:.2f}x" if f["forecast_speedup"] is not None
                else f"none ({f.get('forecast_reason')})")
    measured = (f"{f['measured_speedup']:.2f}x" if f["measured_speedup"] is not None
                else f"not measured ({f.get('measured_reason') or 'no concurrency-1 rounds'})")
    rows = [["tau measured (all eval prompts)", tau],
            [f"forecast speedup at that tau, {f['streams']} request(s) in flight", forecast],
            ["speedup measured at concurrency 1 (acceptance job)", measured],
            ["measured / forecast", fmt(f.get("measured_over_forecast"), 2)],
            [f"break-even tau at {f['streams']} in flight (forecast)",
             break_even_text(f["break_even"]) if f.get("break_even") else "not measured"]]
    text = [f"The run's speedup forecast (forecast/forecast.md, {f.get('accelerator') or 'CPU'}): vLLM serving the "
            f"target with a draft of this run's shape at synthetic acceptance lengths. Here the trained draft is "
            f"placed on it: forecast at tau {tau}: {forecast}; measured {measured}."]
    if not f["is_forecast"]:
        text.append(f"These forecast figures are not a forecast: {f.get('note') or 'see forecast.json'}.")
    return [Section("Speedup forecast against the measured draft", text, [Table(["figure", "value"], rows)], [])] \
        + schedule_sections(result)


def schedule_sections(result: dict) -> list[Section]:
    """The serving schedule (serving_schedule.json beside the report): per forecast k, the trained
    draft's tau at that k and its forecast speedup per concurrency (or why none), the k chosen per
    concurrency, and vLLM's batch-size ranges, or "serve without a draft"."""
    s, f = result.get("serving_schedule"), result.get("forecast")
    if not s or not f:
        return []
    by_k = f.get("by_k") or {}
    streams = sorted({int(n) for per_n in by_k.values() for n in per_n})
    chosen = s.get("k_by_concurrency") or {}
    rows = []
    for k, per_n in sorted(by_k.items(), key=lambda kv: int(kv[0])):
        tau = next((p["tau"] for p in per_n.values()), None)
        rows.append([f"k {k}", "not counted" if tau is None else f"{tau:.2f}"]
                    + [fmt(per_n[str(n)]["speedup"], 2) if per_n.get(str(n), {}).get("speedup") is not None
                       else "-" for n in streams])
    rows.append(["chosen k", ""] + [str(chosen[str(n)]) if str(n) in chosen else "-" for n in streams])
    why = [f"k {k} at {n} in flight: {reason}" for k, per_n in (s.get("not_chosen") or {}).items()
           for n, reason in per_n.items()]
    text = [f"Serving schedule (serving_schedule.json): {schedule.ranges_text(s)}. At each concurrency the forecast "
            f"measured, the k whose curve gives the trained draft's tau at that k (1 + the first k per-position "
            f"acceptance rates) the highest speedup, 0 where none beats the target alone; between measured "
            f"concurrencies the boundary is their geometric midpoint, the last k holds to max_num_seqs "
            f"{s.get('max_num_seqs')}."]
    if s.get("speculative_config"):
        text.append(f"Pass it to vLLM: vllm serve TARGET --max-num-seqs {s['max_num_seqs']} --speculative-config "
                    f"'{json.dumps(s['speculative_config'])}' (checked by {s.get('checked_by')}).")
    if why:
        text.append("Left out (a forecast does not extrapolate): " + "; ".join(why) + ".")
    if not f["is_forecast"]:
        text.append(f"Not a forecast: {f.get('note') or 'see forecast.json'}; neither is this schedule.")
    head = ["k", "tau at k"] + [f"{n} in flight" for n in streams]
    return [Section("Serving schedule (k per batch size)", text, [Table(head, rows)], [])]
