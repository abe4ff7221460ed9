"""The measured draft placed on the run's speedup forecast (rules/forecast.smk): the forecast's
speedup at the tau this draft measured, beside the speedup measured at concurrency 1, and the
break-even tau. Only when the run has a forecast (forecast.enabled)."""
from __future__ import annotations

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
    return [Section("Speedup forecast against the measured draft", text, [Table(["figure", "value"], rows)], [])]
