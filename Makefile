# Two commands on a fresh machine: `make run` and `make test`. Everything else is set up here.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-10)

# llama-cpp-python ships as an sdist only: build it once per CPU and Python, keep the wheel
# outside git. On x86_64, CPUs here advertise AMX the sandbox cannot run (SIGSEGV in
# ggml_backend_amx_mul_mat); gcc rejects those flags on ARM, where the plain native build is right.
LLAMA_VERSION := 0.3.36
ARCH := $(shell uname -m)
CPU_ID := $(shell (grep -m1 -E '^(flags|Features)' /proc/cpuinfo; $(PYTHON) -V) | sha1sum | cut -c1-10)
WHEEL_DIR ?= $(HOME)/.cache/granary/wheels/$(ARCH)-$(CPU_ID)
ifeq ($(ARCH),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
else
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON
endif

.PHONY: run test bench soak lint install tools wheel wheel-invariant wheel-row-invariant peer-server clean

run: $(STAMP)
	$(BIN)/granary prepare >/dev/null
	$(BIN)/granary up

test: $(STAMP) tools
	$(BIN)/python -m pytest -q -ra

bench: $(STAMP) wheel-invariant wheel-row-invariant peer-server
	$(BIN)/python -m bench.run --invariant-site $(INVARIANT_SITE) \
	  --row-invariant-site $(ROW_INVARIANT_SITE) --peer-server $(PEER_SERVER)

# Not part of `make test`: 1,000 SSE listeners and a 30 s Redis outage (a few minutes); writes docs/SOAK.md.
soak: $(STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy api worker warmer shared cli

install: $(STAMP)

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
	@ls $(WHEEL_DIR)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || { \
	  mkdir -p $(WHEEL_DIR) && \
	  echo "building llama-cpp-python $(LLAMA_VERSION) (4-5 minutes on 2 cores)..." && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel --no-deps -w $(WHEEL_DIR) \
	    llama-cpp-python==$(LLAMA_VERSION); }

# For bench/batch_rows.py only: llama.cpp without llamafile's sgemm, whose code path depends on
# the number of rows in a batch (the bench turns off the other two such kernels at run time).
# Installed beside the venv, never into it.
INVARIANT_DIR := $(WHEEL_DIR)/batch-invariant
INVARIANT_SITE := $(INVARIANT_DIR)/site
wheel-invariant: $(STAMP)
	@test -d $(INVARIANT_SITE)/llama_cpp || { \
	  echo "building batch-invariant llama-cpp-python $(LLAMA_VERSION) (4-5 minutes)..." && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) -DGGML_LLAMAFILE=OFF" $(BIN)/pip wheel --no-deps --no-cache-dir \
	    --no-binary llama-cpp-python -w $(INVARIANT_DIR) llama-cpp-python==$(LLAMA_VERSION) && \
	  $(BIN)/pip install -q --no-deps --target $(INVARIANT_SITE) \
	    $(INVARIANT_DIR)/llama_cpp_python-$(LLAMA_VERSION)-*.whl; }

# For bench/batch_rows.py only: llama.cpp whose three row-count-dependent kernels (llamafile's
# sgemm, repacked weights' gemm and its 4-row interleaved quantisation of the activations, the
# tiled K-quant path; ARM's two-row mmla dot too) start at ROW_INVARIANT_BELOW rows instead of
# 2, 4 or 8, so a decode step of fewer rows computes each row as a lone decode does, while
# prefill chunks keep the fast kernels. Each patch fails the build if its text is not found.
ROW_INVARIANT_BELOW := 32
ROW_INVARIANT_DIR := $(WHEEL_DIR)/row-invariant
ROW_INVARIANT_SITE := $(ROW_INVARIANT_DIR)/site
ROW_INVARIANT_SRC := $(ROW_INVARIANT_DIR)/src/llama_cpp_python-$(LLAMA_VERSION)
CPU_SRC := $(ROW_INVARIANT_SRC)/vendor/llama.cpp/ggml/src/ggml-cpu
ROWS := $(ROW_INVARIANT_BELOW)
wheel-row-invariant: $(STAMP)
	@test -d $(ROW_INVARIANT_SITE)/llama_cpp || { \
	  echo "building row-invariant llama-cpp-python $(LLAMA_VERSION) (4-5 minutes)..." && \
	  rm -rf $(ROW_INVARIANT_DIR) && mkdir -p $(ROW_INVARIANT_DIR)/src && \
	  $(BIN)/pip download -q --no-deps --no-binary :all: -d $(ROW_INVARIANT_DIR)/src \
	    llama-cpp-python==$(LLAMA_VERSION) && \
	  tar xzf $(ROW_INVARIANT_DIR)/src/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(ROW_INVARIANT_DIR)/src && \
	  edit() { grep -qF "$$2" "$$1" && sed -i "s/$$3/$$4/" "$$1" && grep -qF "$$5" "$$1" || \
	    { echo "$$1: no '$$2' to patch"; exit 1; }; } && \
	  edit $(CPU_SRC)/llamafile/sgemm.cpp '    if (n < 2)' '^    if (n < 2)$$' '    if (n < $(ROWS))' \
	    '    if (n < $(ROWS))' && \
	  edit $(CPU_SRC)/repack.cpp '        if (nrows > 3) {' '^        if (nrows > 3) {$$' \
	    '        if (nrows >= $(ROWS)) {' '        if (nrows >= $(ROWS)) {' && \
	  edit $(CPU_SRC)/repack.cpp 'for (int iter = nrows - (nrows % 4); iter < nrows' \
	    'for (int iter = nrows - (nrows % 4); iter < nrows' \
	    'for (int iter = nrows >= $(ROWS) ? nrows - (nrows % 4) : 0; iter < nrows' \
	    'nrows >= $(ROWS) ? nrows - (nrows % 4) : 0' && \
	  edit $(CPU_SRC)/repack.cpp 'i11 < ne11 - ne11 % 4;' 'ne11 - ne11 % 4' \
	    '(ne11 >= $(ROWS) ? ne11 - ne11 % 4 : 0)' 'i11 < (ne11 >= $(ROWS) ? ne11 - ne11 % 4 : 0);' && \
	  edit $(CPU_SRC)/tiled/tiled.cpp 'return rows >= 8 ||' 'return rows >= 8 ||' \
	    'return rows >= $(ROWS) ||' 'return rows >= $(ROWS) ||' && \
	  edit $(CPU_SRC)/ggml-cpu.c 'if ((nr0 % 2 != 0) || (ne11 % 2 != 0)' \
	    'if ((nr0 % 2 != 0) || (ne11 % 2 != 0)' 'if ((ne11 < $(ROWS)) || (nr0 % 2 != 0) || (ne11 % 2 != 0)' \
	    '(ne11 < $(ROWS)) ||' && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel --no-deps --no-cache-dir \
	    -w $(ROW_INVARIANT_DIR) $(ROW_INVARIANT_SRC) && \
	  $(BIN)/pip install -q --no-deps --target $(ROW_INVARIANT_SITE) \
	    $(ROW_INVARIANT_DIR)/llama_cpp_python-$(LLAMA_VERSION)-*.whl && \
	  rm -rf $(ROW_INVARIANT_DIR)/src; }

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

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	$(MAKE) wheel
	@# The distribution was called granary before granary-llm; two would own the same modules.
	$(BIN)/pip uninstall -q -y granary 2>/dev/null || true
	$(BIN)/pip install -q --find-links $(WHEEL_DIR) --only-binary llama-cpp-python -e '.[dev,qwen,gemma,bench]'
	rm -f $(VENV)/.installed-*
	touch $@

clean:
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache
