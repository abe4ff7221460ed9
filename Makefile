# The two commands a newcomer needs:
#   make demo   build the environment (first time: a few minutes), then run the whole
#               pipeline on the demo default (config.yaml) -> results/smollm2-135m-demo/
#   make test   same environment, then the test suite (this is what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
CORES ?= 2
PYTEST_ARGS ?=

.PHONY: env demo test lint dry-run plan clean-demo

env:
	@bash scripts/setup_env.sh $(VENV)

demo: env
	@echo "[demo] running the pipeline on config.yaml (see README for what it builds)"
	$(SNAKEMAKE) --profile profiles/default --cores $(CORES)

test: env
	@echo "[test] running the test suite (tests/)"
	$(PY) -m pytest tests $(PYTEST_ARGS)

lint: env
	$(SNAKEMAKE) --lint

dry-run: env
	$(SNAKEMAKE) --profile profiles/default -n

clean-demo:
	@echo "[clean] results/ is never deleted by make; remove results/<run_name> by hand if you mean it."
