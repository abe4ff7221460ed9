"""The report's plots (matplotlib, embedded as base64 PNG), by the title a section names them with."""
from __future__ import annotations

from typing import Any

from ..io import get_in
from ..render import png
from .training import acc_columns

def make_plots(metrics: list[dict], acceptance: dict, suites: dict | None = None) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    plots: dict[str, str] = {}
    splits = sorted({r["split"] for r in metrics})
    if metrics:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for split in splits:
            rs = sorted((r for r in metrics if r["split"] == split and isinstance(r.get("loss"), float)),
                        key=lambda r: r["epoch"])
            ax.plot([r["epoch"] for r in rs], [r["loss"] for r in rs], marker="o", label=split)
        ax.set(xlabel="epoch", ylabel="loss", title="Training loss")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        plots["Training loss per epoch"] = png(fig)
        accs = acc_columns(metrics)
        if accs:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            for split in splits:
                rs = sorted((r for r in metrics if r["split"] == split), key=lambda r: r["epoch"])
                for i, col in enumerate(accs):  # one colour per position; val solid, train dashed
                    ax.plot([r["epoch"] for r in rs], [r.get(col) for r in rs], marker="o", color=f"C{i}",
                            linestyle="-" if split == "val" else "--", label=f"{split} {col}")
            ax.set(xlabel="epoch", ylabel="accuracy", title="Per-position accuracy", ylim=(0, 1))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7)
            plots["Per-position accuracy per epoch"] = png(fig)
    if acceptance.get("status") == "ok":
        trained = get_in(acceptance, "acceptance", "trained", "acceptance_rate_per_position") or []
        untrained = get_in(acceptance, "acceptance", "untrained", "acceptance_rate_per_position") or []
        if trained:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            xs = list(range(len(trained)))
            ax.bar([x - 0.2 for x in xs], trained, width=0.4, label="trained")
            ax.bar([x + 0.2 for x in xs], untrained or [0] * len(xs), width=0.4, label="untrained")
            ax.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance rate per position",
                   xticks=xs, ylim=(0, 1))
            ax.legend()
            plots["Acceptance rate per position"] = png(fig)
        cats = get_in(acceptance, "per_category", "trained") or {}
        if cats:
            names = sorted(cats)
            fig, ax = plt.subplots(figsize=(6, 3.2))
            xs = list(range(len(names)))
            ax.bar([x - 0.2 for x in xs], [cats[n]["mean_acceptance_length"] or 0 for n in names], width=0.4, label="trained")
            unt = get_in(acceptance, "per_category", "untrained") or {}
            ax.bar([x + 0.2 for x in xs], [(unt.get(n) or {}).get("mean_acceptance_length") or 0 for n in names],
                   width=0.4, label="untrained")
            ax.set_xticks(xs, names, rotation=30, ha="right")
            ax.set(ylabel="mean acceptance length", title="Acceptance length per category")
            ax.legend()
            plots["Acceptance length per category"] = png(fig)
        groups = [(label, get_in(acceptance, "throughput", key)) for label, key in
                  (("batch (all prompts)", "batch"), ("concurrency 1", "concurrency_1"))]
        groups = [(label, g) for label, g in groups if g]
        if groups:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            xs = list(range(len(groups)))
            ax.bar([x - 0.2 for x in xs], [g["without_draft"]["tokens_per_s"] or 0 for _, g in groups], width=0.4,
                   label="without draft")
            ax.bar([x + 0.2 for x in xs], [g["with_draft"]["tokens_per_s"] or 0 for _, g in groups], width=0.4,
                   label="with draft")
            ax.set_xticks(xs, [label for label, _ in groups])
            ax.set(ylabel="output tokens/s", title="Throughput")
            ax.legend()
            plots["Throughput with and without the draft"] = png(fig)
    fig = suites_plot(suites, plt)
    if fig is not None:
        plots["Acceptance length per suite and category (95% intervals)"] = png(fig)
    return plots


def suites_plot(suites: dict | None, plt) -> Any:
    if not suites:
        return None
    labels, values, lows, highs = [], [], [], []
    for name, s in suites["trained"]["figures"].items():
        name = (suites.get("labels") or {}).get(name, name)
        for label, v in [(f"{name}", s), *((f"{name}: {c}", cv) for c, cv in s["per_category"].items())]:
            if v["mean_acceptance_length"] is None:
                continue
            lo, hi = v["interval"] or [v["mean_acceptance_length"]] * 2
            labels.append(label)
            values.append(v["mean_acceptance_length"])
            lows.append(v["mean_acceptance_length"] - lo)
            highs.append(hi - v["mean_acceptance_length"])
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(labels) + 1.2))
    y = list(range(len(labels)))[::-1]
    colors = ["C0" if ":" not in label else "C1" for label in labels]
    ax.errorbar(values, y, xerr=[lows, highs], fmt="none", ecolor="gray", capsize=3)
    ax.scatter(values, y, c=colors, zorder=3)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("mean acceptance length (tau), 95% interval")
    ax.axvline(1.0, color="lightgray", linestyle=":")
    # Room on both sides: 1.0 (no help) always in view, no point on the frame.
    ax.set_xlim(min(1.0, *(v - lo for v, lo in zip(values, lows))) - 0.1,
                max(v + hi for v, hi in zip(values, highs)) + 0.1)
    fig.tight_layout()
    return fig
