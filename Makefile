# The two commands a newcomer needs:
#   make demo   build the environment (first time: a few minutes), then run the whole
#               pipeline on the demo default (config.yaml) -> results/smollm2-135m-demo/
#   make test   same environment plus SLURM (apt, once), then the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
CORES ?= 2
PYTEST_ARGS ?=
# Rules call `python`: make it the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: env slurm demo test lint dry-run plan check-provenance

env:
	@bash scripts/setup_env.sh $(VENV)

demo: env
	@echo "[demo] running the pipeline on config.yaml (see README for what it builds)"
	$(SNAKEMAKE) --profile profiles/default --cores $(CORES)

# The cluster-profile test runs a real single-node SLURM: Debian packages, installed once (root).
slurm:
	@bash .ci/install_slurm.sh

test: env slurm
	@echo "[test] running the test suite (tests/)"
	$(PY) -m pytest tests $(PYTEST_ARGS)

lint: env
	$(SNAKEMAKE) --lint

dry-run: env
	$(SNAKEMAKE) --profile profiles/default -n

plan: env
	$(SNAKEMAKE) --profile profiles/default plan


# Verify a finished results tree against the digests its provenance files recorded.
check-provenance: env
	$(PY) scripts/check_provenance.py results/$(or $(RUN),smollm2-135m-demo)
