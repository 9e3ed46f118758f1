# kvgate: `make demo` runs the demo, `make test` runs the whole test suite.
# Both create .venv on first use and reuse it afterwards (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check -q
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint system-packages redis-server vllm-venv clean

# A real vLLM (CPU build, pinned in tests/vllm-requirements.txt) for tests/test_vllm_real.py, in a
# venv of its own: it pins its own torch and libraries. torchvision/torchaudio/torchcodec come with
# it and break `import vllm` on CPU. About 4 minutes from nothing; 3.5 GB.
VLLM_VENV ?= .venv-vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base-installed: pyproject.toml setup.py | $(BIN)/python
	$(PIP) install -e .
	touch $@ $(VENV)/.compiled

$(VENV)/.dev-installed: pyproject.toml setup.py | $(BIN)/python
	$(PIP) install -e '.[dev,agent]'
	touch $@ $(VENV)/.base-installed $(VENV)/.compiled

# The request-path policy modules are compiled with mypyc in place (setup.py, policies/native.py);
# after an edit they are rebuilt (about 25 s) -- until then `import policies` runs the source.
$(VENV)/.compiled: policies/*.py | $(VENV)/.base-installed
	$(PIP) install --no-deps -e .
	touch $@

# Debian packages the tests use, as program:package. Those whose program is missing are installed
# in one apt-get call; when all are there this is a few `command -v` checks and nothing else.
#   redis-server  shared-state tests, `kvgate up`       nginx          the compose entry point, locally
#   prometheus    scrapes the local stack (+ promtool)  docker-compose validates compose.yaml (no daemon)
#   wrk           the proxy benchmark's load generator (its end-to-end test)
SYSTEM_PACKAGES := redis-server:redis-server nginx:nginx-light prometheus:prometheus docker-compose:docker-compose wrk:wrk

system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v "$${p%%:*}" >/dev/null || missing="$$missing $${p#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

redis-server: system-packages

$(VLLM_VENV)/.installed: tests/vllm-requirements.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip --disable-pip-version-check -q install -r tests/vllm-requirements.txt
	$(VLLM_VENV)/bin/pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

demo: $(VENV)/.base-installed $(VENV)/.compiled
	$(BIN)/kvgate demo

test: $(VENV)/.dev-installed $(VENV)/.compiled system-packages $(VLLM_VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache *.egg-info build *.so policies/*.so
