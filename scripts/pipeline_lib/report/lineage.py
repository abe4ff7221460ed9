"""Built from: the upstream stage instances the draft descends from and the variant's settings."""
from __future__ import annotations

from ..render import Section, Table, fmt

def sections(result: dict) -> list[Section]:
    lineage = result["lineage"]
    instances = lineage.get("stage_instances") or {}
    changed = lineage.get("changed_settings") or {}
    return [Section("Built from", [
        "The upstream artifacts this draft descends from (results/<run>/<directory>): a stage keeps the base "
        "config's directory unless this variant changes its settings, then it gets <stage>-<digest of its "
        "settings>, shared by every variant with the same settings. "
        + ("Settings that differ from the base config: " + ", ".join(f"`{k}` = {fmt(v)}" for k, v in changed.items())
           + "." if changed else "This variant uses the base config's settings.")],
        [Table(["stage", "directory"], [[stage, d] for stage, d in instances.items()])] if instances else [])]
