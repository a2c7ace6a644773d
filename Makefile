# `make run`: set up and generate with the built-in default. `make test`: set up and run the quick
# tests (under 5 minutes on 2 cores); `make test-all`: every test (CI). `make shell`: a shell with .venv on PATH.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

# torch is pinned and installed first: an unpinned torch, or torch==2.13.0 from PyPI on Linux,
# is a multi-GB CUDA build. TORCH_INDEX is where it comes from: by default PyTorch's CPU index
# on a machine without an NVIDIA GPU (no nvidia-smi) when that index answers, else pip's own
# indexes (on machines with a CPU build of torch on local disk, that one). Set it to choose:
# `make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126` (a CUDA build), or
# `make setup TORCH_INDEX=` (pip's default).
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || { python3 -c "import urllib.request as u; \
	u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1 && echo $(TORCH_CPU_INDEX); })

.PHONY: setup run shell test test-all clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	index="$(TORCH_INDEX)"; $(PIP) torch==$(TORCH_VERSION) $${index:+--index-url "$$index"}
	$(PIP) -e '.[hf,gemma,bench,test,serve,ray,sharegpt,clients]'
	touch $@

run: setup
	$(VENV)/bin/speculative generate

# A shell whose PATH starts with .venv/bin (`speculative`, `python`, `pytest`); `exit` leaves it.
# Or, in the current shell: source .venv/bin/activate
shell: setup
	@echo "speculative is on PATH in this shell ($(abspath $(VENV))/bin); exit to leave it"
	@VIRTUAL_ENV="$(abspath $(VENV))" PATH="$(abspath $(VENV))/bin:$$PATH" $${SHELL:-/bin/sh}

# The quick run leaves out tests marked slow (long statistical and end-to-end tests);
# every fast path's exactness is still tested in it. It runs TEST_WORKERS pytest-xdist
# workers, a test file each at a time, on one torch thread each (tests/conftest.py): under 5
# minutes on 2 cores. `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# Every test, as CI runs them: the quick run above (the README's command), then the slow
# tests (Ray clusters, servers and long statistical tests), a test file per worker at a time.
test-all: test
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
