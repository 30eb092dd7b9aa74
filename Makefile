# Two commands on a fresh machine; each sets up .venv on first use (idempotent: a second run installs nothing).
#   make demo   the main job: train the small GPT on n-digit addition with the monitor attached
#   make test   the test suite (what CI runs, via .ci/run)
# Other targets: make docs (the documentation site, into build/docs; runs the example gallery), make setup (the
# environment alone), make docs-keys (rewrite docs/metrics.md's key tables), make cost-model (count the GPU cost
# model again: benchmarks/results/cost_model.json and docs/cost_model.md's tables).

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
PY := $(VENV)/bin/python

.PHONY: demo test setup docs docs-keys cost-model

setup: $(STAMP)

# Re-installs only when pyproject.toml or the constraints changed. The CPU build of torch first: a plain `torch`
# requirement would pull a multi-GB CUDA build.
# transformers 5 needs huggingface-hub >= 1.31 and litgpt pins < 1.4, so one resolver call would fall back to an
# old transformers: transformers first, then litgpt, then the hub again (litgpt still imports). Versions: .ci/constraints.txt.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c .ci/constraints.txt -e ".[dev,hf]"
	$(PY) -m pip install -q -c .ci/constraints.txt "litgpt>=0.5.13,<0.6"
	$(PY) -m pip install -q "huggingface-hub>=1.31,<2"
	touch $(STAMP)

demo: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m examples.demo $(ARGS)

# The lint first (ruff, seconds), then the suite; the architecture contracts (import-linter) run inside it.
test: $(STAMP)
	$(VENV)/bin/ruff check curvwatch tests benchmarks examples docs
	WANDB_MODE=$${WANDB_MODE:-offline} WANDB_SILENT=true $(PY) -m pytest -q $(ARGS)

# The docs' own dependencies (the docs extra), on top of the main environment; again only when pyproject.toml changed.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -c .ci/constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

# Warnings are errors (nitpicky references included); the gallery's examples run on the CPU, a few minutes in all.
docs: $(DOCS_STAMP)
	WANDB_MODE=disabled WANDB_SILENT=true OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
		$(PY) -m sphinx -b html -W --keep-going docs build/docs $(ARGS)

docs-keys: $(STAMP)
	$(PY) -m curvwatch.keys docs/metrics.md

# The GPU cost model counted on the CPU at the checkout's code (about an hour on two cores, the two models one after the
# other): each count is kept in build/cost_counts.json as it is made, so a stopped run goes on where it stopped (only
# from counts of the same commit). ARGS="--quick" counts a tiny shape in a minute (into build/, not the committed files).
COST_OUT := $(if $(findstring --quick,$(ARGS)),--out build/cost_model_quick.json --partial build/cost_counts_quick.json,\
	--out benchmarks/results/cost_model.json --docs docs/cost_model.md --partial build/cost_counts.json \
	--checks build/cost_checks.json)
cost-model: $(STAMP)
	mkdir -p build
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m benchmarks.cost_model $(COST_OUT) $(ARGS)
