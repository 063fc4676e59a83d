# Two commands for a newcomer on a fresh machine:
#   make demo   set up a virtualenv, install, and run the local demo swarm
#   make test   set up a virtualenv with the dev tools, and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch. GPU owners: `pip install torch` from pytorch.org's CUDA index first.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test venv install-dev lint protos bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[node,coordinator,client]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/tessera demo

test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

protos: $(VENV)/.installed-dev
	$(BIN)/python -m protos.generate

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/control_plane.py
	$(BIN)/python bench/inference.py
	$(BIN)/python bench/push_pipeline.py
	$(BIN)/python bench/placement.py
	$(BIN)/python bench/training.py
	$(BIN)/python bench/verification.py
	$(BIN)/python bench/hedging.py
	$(BIN)/python bench/relay.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
