# Two entry points on a fresh machine: `make demo` and `make test`. Each creates .venv and
# installs the project into it on first use.
PYTHON ?= python3
VENV ?= .venv
WORKDIR ?= workdirs/smollm2_demo
PYTEST_ARGS ?=

BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench,peer,serve,notebook,data,gcs]'
	touch $@

.PHONY: install demo demo-scratch test clean
install: $(VENV)/.installed

# An EAGLE-3 drafter for SmolLM2 (imported once into workdirs/smollm2), trained and measured.
demo: $(VENV)/.installed
	$(BIN)/python -m launch.demo --workdir=$(WORKDIR)

# The from-scratch demo: a small MTP model trained jointly on the standard library.
demo-scratch: $(VENV)/.installed
	$(BIN)/python -m launch.demo --config=configs/code_small.py --workdir=workdirs/code_small

# XLA:CPU (jaxlib 0.10.2) now and then segfaults or aborts a worker while it compiles a program,
# or loads or writes it in the persistent compilation cache (1-3 tests a run; the last 8 all in
# eagle3_test, 4 of them in its `counting`, which alone never crashed in 32 runs, nor in 16 runs
# of the whole module in one process). Torch is not the cause: the torch oracles now run in
# processes of their own (`mtp.testing.oracle_process`), and the next crash (eagle3_test.py:439,
# 2026-12-06) came in a worker without torch, in `executable.serialize()` as jax wrote the
# engine's step to the persistent cache. A crashed test runs once more on a fresh worker. Only
# crashes: `--only-rerun` matches no failure a test reports. Plain `--dist=load`: xdist 3.8's
# group and scope schedulers (loadgroup, loadscope, loadfile) cannot rerun a crashed test (it
# counts as failed), and one run hung after a crash; under pytest 9.2 loadgroup also groups
# nothing (it renames node ids through an attribute pytest 9.2 no longer reads).
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --reruns=1 --only-rerun='^crashed-worker$$' $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) workdirs results .pytest_cache
