"""The report's sections in reading order: each a module of this package whose `sections(result)`
returns its Sections (pipeline_lib.render turns them into Markdown and HTML)."""
from __future__ import annotations

from ..render import Section
from . import acceptance, contract, forecast, headline, lineage, provenance, suites, throughput, training, verdict

# What a user reads first, then the details.
SECTIONS = [headline, verdict, suites, acceptance, throughput, forecast, contract, training, lineage, provenance]


def build_sections(result: dict, plots: dict[str, str]) -> list[Section]:
    out = [s for module in SECTIONS for s in module.sections(result)]
    for s in out:
        s.plots = [p for p in s.plots if p in plots]
    return out
