# `make test`, `make demo` and `make docs` work on a fresh clone: they create .venv and install everything first.
# torch is pinned through constraints.txt to the CPU build that lies on this machine's disk; spikingjelly and
# norse are installed without their declared dependencies (they would pull a CUDA torch and torchvision).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
PIPQ   := $(PIP) install -q --disable-pip-version-check -c constraints.txt

.PHONY: install test demo docs bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIPQ) torch==2.13.0
	$(PIPQ) -e '.[test,train,bench]'
	$(PIPQ) --no-deps spikingjelly==2.0.0 norse==1.1.0 nirtorch
	touch $(STAMP)

# Two worker processes, a test file each at a time: a cold run is mostly numba compiling kernels, one process per
# core (CI has 2), and a file's kernels are compiled once, by the worker that runs the file.
test: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests

# A rerun replaces the earlier demo run; `make demo ARGS="--resume --epochs 12"` passes options instead.
demo: install
	$(VENV)/bin/spikefuse train --out runs/demo $(if $(ARGS),$(ARGS),--overwrite)

$(DOCS_STAMP): $(STAMP)
	$(PIPQ) -e '.[docs]'
	touch $(DOCS_STAMP)

# The HTML goes to site/; --strict fails the build on any warning. NO_MKDOCS_2_WARNING silences the banner
# mkdocs-material prints at every start (the theme's end of life in 2027: news about the tool, not about these docs).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) runs .pytest_cache site
