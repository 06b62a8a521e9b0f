# Two entry points on a fresh machine: `make demo` and `make test`. Each creates .venv and
# installs the project into it on first use.
PYTHON ?= python3
VENV ?= .venv
WORKDIR ?= workdirs/code_small
PYTEST_ARGS ?=

BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench,peer,serve,notebook,data]'
	touch $@

.PHONY: install demo test clean
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/python -m launch.demo --workdir=$(WORKDIR)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) workdirs results .pytest_cache
