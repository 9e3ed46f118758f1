# kvgate: `make demo` runs the demo, `make test` runs the whole test suite.
# Both create .venv on first use and reuse it afterwards (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check -q
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint redis-server clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base-installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[dev]'
	touch $@ $(VENV)/.base-installed

redis-server:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }

demo: $(VENV)/.base-installed
	$(BIN)/kvgate demo

test: $(VENV)/.dev-installed redis-server
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
