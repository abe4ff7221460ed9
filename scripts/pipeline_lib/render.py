"""The document model the reports are written in (sections of text, tables and plots), rendered
to Markdown (for a terminal or a PR) and to self-contained HTML (plots embedded as PNG; no
external links or files). Used by make_report.py (one draft) and compare_variants.py (all)."""
from __future__ import annotations

import base64
import html
import io
import json
import re
from dataclasses import dataclass, field
from typing import Any


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, list) and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.{digits}f}" for v in value) + "]"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


def png(fig) -> str:
    """A matplotlib figure as base64 PNG (closed afterwards)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)


def _md_cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def render_markdown(sections: list[Section], html_name: str = "report.html") -> str:
    out = []
    for i, s in enumerate(sections):
        out.append(("# " if i == 0 else "## ") + s.title + "\n")
        out += [t + "\n" for t in s.text]
        for t in s.tables:
            out.append("| " + " | ".join(t.headers) + " |")
            out.append("|" + "---|" * len(t.headers))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
            out.append("")
        for p in s.plots:
            out.append(f"_Plot: {p} (see {html_name})._\n")
    return "\n".join(out)


def _inline_md(text: str) -> str:
    """The little Markdown the texts use (**bold**, `code`), escaped for HTML."""
    t = html.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", t)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", t)


def render_html(title: str, sections: list[Section], plots: dict[str, str]) -> str:
    css = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
           "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}"
           "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}"
           "th{background:#f3f3f3}code{background:#f6f6f6}img{max-width:48%;margin:.3em}"
           ".PASS{color:#06702a;font-weight:bold}.FAIL,.MISMATCH{color:#b00020;font-weight:bold}")
    body = []
    for i, s in enumerate(sections):
        tag = "h1" if i == 0 else "h2"
        body.append(f"<{tag}>{html.escape(s.title)}</{tag}>")
        for t in s.text:
            if t.startswith("- "):
                body.append(f"<ul><li>{_inline_md(t[2:])}</li></ul>")
            else:
                body.append("".join(f"<p>{_inline_md(par)}</p>" for par in t.split("\n\n")))
        for t in s.tables:
            body.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in t.headers) + "</tr>")
            for row in t.rows:
                cells = []
                for c in row:
                    c = str(c)
                    cls = f' class="{c}"' if c in ("PASS", "FAIL", "MISMATCH") else ""
                    cells.append(f"<td{cls}>{html.escape(c)}</td>")
                body.append("<tr>" + "".join(cells) + "</tr>")
            body.append("</table>")
        for p in s.plots:
            body.append(f'<img alt="{html.escape(p)}" title="{html.escape(p)}" src="data:image/png;base64,{plots[p]}">')
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{css}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
