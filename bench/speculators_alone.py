#!/usr/bin/env python
"""speculators' training entry point, as `python -m speculators.train ARGV` runs it (the two
lines of speculators/train/__main__.py). Only on a machine without CUDA are the pipeline's CPU
shims applied first (speculators 0.9.0 cannot train on CPU otherwise): BENCH_SMOKE runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

if __name__ == "__main__":
    from pipeline_lib import runtime, speculators_cpu

    runtime.setup()
    if not runtime.has_cuda():
        speculators_cpu.apply()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(sys.argv[1:]))
