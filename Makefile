# Two commands on a fresh machine: `make run` and `make test`. Everything else is set up here.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

# llama-cpp-python ships as an sdist only: deploy/build-llama-wheel.sh builds it (with llama.cpp's
# row-count thresholds moved, see there) once per CPU, Python and build rule, outside git.
LLAMA_VERSION := 0.3.36
LLAMA_BUILD := deploy/build-llama-wheel.sh
LLAMA_BUILD_FILES := $(LLAMA_BUILD) deploy/llama-flash-attn-tiles.patch deploy/llama-kquant-rows.patch \
  deploy/llama-prompt-rows.patch
ARCH := $(shell uname -m)
CPU_ID := $(shell (grep -m1 -E '^(flags|Features)' /proc/cpuinfo; $(PYTHON) -V) | sha1sum | cut -c1-10)
WHEEL_DIR ?= $(HOME)/.cache/granary/wheels/$(ARCH)-$(CPU_ID)
LLAMA_WHEELS := $(WHEEL_DIR)/granary-$(shell cat $(LLAMA_BUILD_FILES) | sha1sum | cut -c1-10)
INSTALL_ID := $(shell cat pyproject.toml $(LLAMA_BUILD_FILES) | sha1sum | cut -c1-10)
# Each command installs what it needs: `run` the default model only, `test` the test models
# and tools, `bench` what the peers need too.
STAMP := $(VENV)/.installed-$(INSTALL_ID)
TEST_STAMP := $(VENV)/.installed-test-$(INSTALL_ID)
BENCH_STAMP := $(VENV)/.installed-bench-$(INSTALL_ID)
ifeq ($(ARCH),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
else
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON
endif

.PHONY: run test bench soak lint install tools wheel wheel-stock wheel-invariant peer-server clean

run: $(STAMP)
	$(BIN)/granary prepare >/dev/null
	$(BIN)/granary up

test: $(TEST_STAMP) tools
	$(BIN)/python -m pytest -q -ra --durations=40 -n 2 --dist loadscope -m "not all_cores"
	$(BIN)/python -m pytest -q -ra --durations=10 -m all_cores

bench: $(BENCH_STAMP) wheel-stock wheel-invariant peer-server
	$(BIN)/python -m bench.run --stock-site $(STOCK_SITE) --invariant-site $(INVARIANT_SITE) \
	  --peer-server $(PEER_SERVER)

# Not part of `make test`: 1,000 SSE listeners and a 30 s Redis outage (a few minutes); writes docs/SOAK.md.
soak: $(TEST_STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy api worker warmer shared cli bench

install: $(TEST_STAMP)

# Tools the deploy tests run (command:Debian package): docker-compose parses compose.yaml without
# a Docker engine; systemd-analyze verifies the units. Installed only when missing (needs root).
DEPLOY_TOOLS := docker-compose:docker-compose systemd-analyze:systemd
tools:
	@missing=$$(for t in $(DEPLOY_TOOLS); do command -v $${t%%:*} >/dev/null || echo $${t#*:}; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "not root, so not installing:" $$missing "(their tests skip, and fail under CI=true)"; \
	  exit 0; fi; \
	echo "installing" $$missing "..."; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends $$missing >/dev/null

wheel:
	@ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || \
	  PIP=$(BIN)/pip $(LLAMA_BUILD) $(LLAMA_WHEELS)

# For bench/batch_rows.py only, installed beside the venv, never into it: the sdist unchanged
# (stock), and built without llamafile's sgemm (batch-invariant; the bench turns off the other
# two row-count-dependent kernels at run time).
STOCK_SITE := $(WHEEL_DIR)/stock/site
INVARIANT_SITE := $(WHEEL_DIR)/batch-invariant/site
wheel-stock: SITE := $(STOCK_SITE)
wheel-stock: VARIANT := stock
wheel-invariant: SITE := $(INVARIANT_SITE)
wheel-invariant: VARIANT := batch-invariant
wheel-stock wheel-invariant: $(STAMP)
	@test -d $(SITE)/llama_cpp || { PIP=$(BIN)/pip $(LLAMA_BUILD) $(dir $(SITE)) $(VARIANT) && \
	  $(BIN)/pip install -q --no-deps --target $(SITE) $(dir $(SITE))llama_cpp_python-$(LLAMA_VERSION)-*.whl; }

# For bench/conclave.py only: llama.cpp's own `llama-server`, built from the llama.cpp that the
# llama-cpp-python sdist vendors (the same kernels granary runs), with the same CPU flags.
PEER_DIR := $(WHEEL_DIR)/llama-server
PEER_SERVER := $(PEER_DIR)/bin/llama-server
peer-server: $(STAMP)
	@test -x $(PEER_SERVER) || { \
	  echo "building llama.cpp's llama-server from the llama-cpp-python $(LLAMA_VERSION) sdist (5-8 minutes)..." && \
	  rm -rf $(PEER_DIR)/src && mkdir -p $(PEER_DIR)/src && \
	  $(BIN)/pip download -q --no-deps --no-binary :all: -d $(PEER_DIR)/src llama-cpp-python==$(LLAMA_VERSION) && \
	  tar xzf $(PEER_DIR)/src/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(PEER_DIR)/src && \
	  cmake -S $(PEER_DIR)/src/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp -B $(PEER_DIR)/build \
	    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
	    -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF $(LLAMA_CMAKE_ARGS) >/dev/null && \
	  cmake --build $(PEER_DIR)/build --target llama-server -j 2 >/dev/null && \
	  mkdir -p $(PEER_DIR)/bin && cp $(PEER_DIR)/build/bin/llama-server $(PEER_SERVER) && \
	  rm -rf $(PEER_DIR)/src $(PEER_DIR)/build; }

$(STAMP): pyproject.toml $(LLAMA_BUILD_FILES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	$(MAKE) wheel
	@# The distribution was called granary before granary-llm; two would own the same modules.
	$(BIN)/pip uninstall -q -y granary 2>/dev/null || true
	$(BIN)/pip install -q --find-links $(LLAMA_WHEELS) --only-binary llama-cpp-python -e .
	@# A venv made before the build rule changed holds another build of the same version.
	$(BIN)/pip install -q --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	rm -f $(VENV)/.installed-*
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q --find-links $(LLAMA_WHEELS) --only-binary llama-cpp-python -e '.[dev,qwen,gemma]'
	touch $@

$(BENCH_STAMP): $(TEST_STAMP)
	$(BIN)/pip install -q --find-links $(LLAMA_WHEELS) --only-binary llama-cpp-python -e '.[dev,qwen,qwen15b,gemma,bench]'
	touch $@

clean:
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache
