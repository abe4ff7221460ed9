"""The GPU quality recipe's flow (bench/gpu_recipe.sh, configs/gpu-recipe*.yaml) on CPU with the
tiny target (BENCH_SMOKE=1): the same Snakemake targets, the transformers backends for traces,
hidden states and the batched acceptance measurement on every eval suite - the wiring a GPU
run relies on, proven before spending GPU time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_recipe_smoke_measures_every_suite_with_the_batched_backend(tmp_path):
    env = {**os.environ, "BENCH_SMOKE": "1", "PYTHON": sys.executable, "RECIPE_WORKDIR": str(tmp_path)}
    proc = subprocess.run(["bash", "bench/gpu_recipe.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "results/gpu-recipe-smoke"
    acc = json.loads((results / "drafts/default/verify/acceptance.json").read_text())
    assert acc["status"] == "ok" and acc["backend"] == "transformers"
    # Every suite measured, MT-Bench and held-out apart, from the recipe's own config.
    assert set(acc["suites"]) == {"eval", "held-out", "humaneval", "champ"}, acc["suites"]
    assert acc["suites"]["humaneval"] == 4 and acc["suites"]["champ"] == 4
    # The batched measurement equals step-by-step chain speculation on the cross-check prompts.
    check = acc["self_check"]["trained"]
    assert check["compared"] == 2 and check["identical"] == 2, check
    # Traces came from the transformers backend (the recipe's H200 node had no vLLM).
    summary = json.loads((results / "traces/summary.json").read_text())
    assert summary["backends"] == {"transformers": summary["rows"]} and summary["failed"] == 0
    assert (results / "hidden_states/manifest.json").exists()

    # The traces bench the GPU call runs after the recipe, on the smoke run's own target and
    # prompts: it prints its table and writes the side-by-side figures (a broken bench costs a
    # GPU call to find out).
    bench = subprocess.run([sys.executable, "bench/traces_speed.py", "--target", str(tmp_path / "target-tiny"),
                            "--prompts", str(results / "prompts/train.jsonl"), "--num", "8", "--batch-size", "4",
                            "--max-tokens", "8", "--dtype", "float32", "--out", str(tmp_path / "traces_speed.json")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    table = json.loads((tmp_path / "traces_speed.json").read_text())
    assert table["prompts"] == 8 and table["backend"]["batches"] == 2, table
    # Greedy on both paths over the same batches: the same number of generated tokens.
    assert table["backend"]["tokens"] == table["generate_alone"]["tokens"] > 0, table
    assert "ratio backend / generate alone" in bench.stdout
