# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the project with its dev extras through
# constraints.txt, which pins torch==2.13.0 (an unpinned torch pulls a multi-GB CUDA build).
# pip does not byte-compile (--no-compile: all of torch, transformers and mypy took about 70 s
# of the install on 2 cores); the project's interpreters compile what they import, once, and
# keep it in __pycache__, which PYTHONDONTWRITEBYTECODE=1 in the caller's environment would
# forbid (every fresh interpreter, each doc page, CLI run and service worker, would recompile
# torch: CI's pytest took 16:45), so it is not passed on to the recipes.

unexport PYTHONDONTWRITEBYTECODE

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TYPED := remat/ir remat/solver remat/api remat/report remat/cli.py remat/cli_common.py remat/cli_solvers.py remat/client.py remat/pytest_plugin.py remat/torch_compile.py remat/__init__.py remat/_version.py remat/enabling.py

.PHONY: venv test test-all lint typecheck demo bench clean browser docs

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(wildcard remat tests examples benchmarks)
	$(VENV)/bin/mypy $(TYPED)

# mypy runs beside pytest (about 40 s on a cold cache, no longer in front of the suite); either
# failing fails the target.
test: $(STAMP)
	$(VENV)/bin/ruff check $(wildcard remat tests examples benchmarks)
	@$(VENV)/bin/mypy $(TYPED) > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -n 2 --dist worksteal -p no:cacheprovider; rc=$$?; \
	wait $$mypy || rc=1; cat .mypy.out; rm -f .mypy.out; exit $$rc

# Debian's chromium for the browser test of the HTML report (skipped where it is missing).
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	  echo "chromium could not be installed: the browser test will be skipped"

# REMAT_ARTIFACTS: the browser test keeps its page and screenshot in artifacts/.
test-all: lint browser
	REMAT_ARTIFACTS=artifacts $(PY) -m pytest -q -n 2 -p no:cacheprovider -m ''

# The user guide (docs/, mkdocs.yml) into site/, warnings as errors.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m pytest -q -m slow -p no:cacheprovider || [ $$? -eq 5 ]  # 5: no slow case collected
	for f in benchmarks/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis
