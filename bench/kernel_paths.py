#!/usr/bin/env python
"""What a CPU's kernel path changes in the test suite's tiny e2e chain, measured side by side.

Runs the e2e test's whole chain (tests/conftest.py base_test_config on the tiny reasoning
target, real vLLM and speculators, through Snakemake) once per kernel path, with training
variants that differ only in seed and epochs, then compares the paths: traces, hidden-state
bytes, validation accuracy, loss, and acceptance (mean acceptance length, per-position rates,
per prompt). Kernel paths: `native` (what this CPU picks) and `avx2` (torch, oneDNN and vLLM all
capped to AVX2: tests/kernel_path/sitecustomize.py).

    python bench/kernel_paths.py --out bench/results/kernel-paths-<date>.json
    python bench/kernel_paths.py --paths native --epochs 2 4      # fewer runs
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import PY, base_test_config, build_target, snakemake_args, write_config  # noqa: E402

KERNEL_PATHS = {
    "native": {},
    "avx2": {"PIPELINE_TEST_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "PYTHONPATH": str(ROOT / "tests" / "kernel_path")},
}


def cpu_flags() -> list[str]:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= {f for f in line.split(":", 1)[1].split() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2"))}
    return sorted(flags)


def run_chain(work: Path, path: str, seeds: list[int], epochs: list[int]) -> float:
    cfg = base_test_config(build_target("tiny-reasoning"))
    cfg["variants"] = {f"s{s}-e{e}": {"train": {"seed": s, "epochs": e}} for s in seeds for e in epochs}
    # The report's threshold would fail weak variants' builds: measure, don't judge.
    cfg["verify"]["fail_below_threshold"] = False
    env = {**os.environ, **KERNEL_PATHS[path]}
    if "PYTHONPATH" in KERNEL_PATHS[path] and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    start = time.monotonic()
    proc = subprocess.run([PY, "-m", "snakemake", *snakemake_args(work, write_config(work, cfg))],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{path}: snakemake failed:\n{proc.stderr[-6000:]}")
    return time.monotonic() - start


def figures(results: Path) -> dict:
    out = {}
    for vdir in sorted((results / "drafts").iterdir()):
        if not (vdir / "provenance.json").is_file():
            continue
        prov = json.loads((vdir / "provenance.json").read_text())
        acc = json.loads((vdir / "verify" / "acceptance.json").read_text())
        trained = acc["acceptance"]["trained"]
        # Per prompt: 1 + accepted tokens per verify step, from vLLM's per-request metrics.
        per_prompt = [round(1 + sum(r["steps_accepted"]) / max(1, len(r["steps_accepted"])), 3)
                      for r in acc["requests"]["trained"]]
        out[vdir.name] = {
            "val_acc": [prov.get(f"val_acc_{i}") for i in range(3)],
            "val_loss": prov.get("val_loss"),
            "tau": trained["mean_acceptance_length"],
            "rates": trained["acceptance_rate_per_position"],
            "untrained_tau": acc["acceptance"]["untrained"]["mean_acceptance_length"],
            "per_prompt": per_prompt,
        }
    return out


def hs_compare(a: Path, b: Path) -> dict:
    """Byte and value differences between the two paths' hidden-state files (same rows)."""
    from safetensors.torch import load_file

    fa = sorted((a / "hidden_states" / "data" / "hidden_states").glob("hs_*.safetensors"))
    same_bytes, max_rel, n = 0, 0.0, 0
    for f in fa:
        g = b / "hidden_states" / "data" / "hidden_states" / f.name
        if f.read_bytes() == g.read_bytes():
            same_bytes += 1
        x, y = load_file(f)["hidden_states"].float(), load_file(g)["hidden_states"].float()
        max_rel = max(max_rel, float(((x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)).max()))
        n += 1
    return {"files": n, "byte_identical": same_bytes, "max_token_rel_l2": round(max_rel, 5)}


def same_file(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", default=list(KERNEL_PATHS), choices=list(KERNEL_PATHS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / ".work" / "kernel_paths")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    record = {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(), "paths": {}}
    for path in args.paths:
        work = args.work / path
        wall = run_chain(work, path, args.seeds, args.epochs)
        record["paths"][path] = {"wall_s": round(wall, 1), "variants": figures(work / "results" / "tiny")}
        print(f"[{path}] {wall:.0f} s", flush=True)
    if len(args.paths) == 2:
        a, b = (args.work / p / "results" / "tiny" for p in args.paths)
        record["compare"] = {
            "traces_identical": same_file(a / "traces" / "traces.jsonl", b / "traces" / "traces.jsonl"),
            "hidden_states": hs_compare(a, b),
        }
    print(f"\n{'variant':<10} " + " ".join(f"{p + ' val_acc':>24} {p + ' tau':>9} {p + ' rates':>22}" for p in args.paths))
    names = sorted(record["paths"][args.paths[0]]["variants"])
    for v in names:
        row = []
        for p in args.paths:
            f = record["paths"][p]["variants"][v]
            row.append(f"{'/'.join(f'{x:.3f}' for x in f['val_acc']):>24} {f['tau']:>9.3f} "
                       f"{'/'.join(f'{x:.3f}' for x in f['rates']):>22}")
        print(f"{v:<10} " + " ".join(row))
    if "compare" in record:
        print("compare:", json.dumps(record["compare"]))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
