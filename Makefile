# `make run`: set up and generate with the built-in default. `make test`: set up and run the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

# torch is pinned first: 2.13.0 is the CPU build on this machine's disk; an unpinned torch
# could pull a multi-GB CUDA build. The package itself only asks for a range.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[hf,gemma,bench,test,serve,ray,sharegpt]'
	touch $@

run: setup
	$(VENV)/bin/speculative generate

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
