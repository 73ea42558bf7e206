# Tarantella-NT: the two commands of the README.
#   make run    the main job: a distributed training (2 ranks) of the quick-start model
#   make test   every test of every package, the docs build included
#   make wheels the wheels (and sdists) of every package into dist/ (ci/build-wheels.sh)
# Both install what they need first: Debian packages (ci/install-system-deps.sh), a
# virtual environment in .venv, every package in editable mode.

SHELL   := /bin/bash
PYTHON  ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
NP      ?= 2
PACKAGES := tnt-core tnt-comm-gloo tnt-comm-mpi tnt-keras tnt-cli
# what pip installs for each: the MPI backend brings the mpich wheel so no system MPI is needed
INSTALL := -e packages/tnt-core -e packages/tnt-comm-gloo -e "packages/tnt-comm-mpi[mpich]" \
           -e packages/tnt-cli
# tnt-keras' op library compiles against the TensorFlow installed by the line before it
INSTALL_NO_ISOLATION := -e packages/tnt-keras
STAMP   := $(VENV)/.stamp-installed
# the examples' data set, beside the venv rather than in it (ci/requirements-examples.txt)
EXAMPLES_SITE := $(VENV)/examples-site
# uv's pip interface installs into .venv: the same requirements as pip, linked from uv's cache
# (pip takes over a minute unpacking TensorFlow into a fresh venv), with their bytecode
UV      := $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode
INPUTS  := Makefile VERSION ci/install-system-deps.sh ci/requirements-test.txt ci/requirements-lint.txt \
           ci/requirements-examples.txt \
           ci/requirements-build.txt $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml) \
           $(wildcard packages/tnt-comm-gloo/CMakeLists.txt packages/tnt-comm-gloo/csrc/*) \
           $(wildcard packages/tnt-keras/CMakeLists.txt packages/tnt-keras/csrc/*) \
           $(wildcard packages/tnt-core/src/tnt_core/include/*.h)

.PHONY: help setup run test tox docs bench wheels clean

help:
	@echo "make run    distributed training of the quick-start model on $(NP) ranks"
	@echo "make test   every test (installs system packages, .venv and the packages first)"
	@echo "make tox    the same through tox, one environment per package"
	@echo "make docs   build the documentation into docs/_build/html"
	@echo "make bench  the allreduce benchmarks"
	@echo "make wheels the wheels of every package into dist/ (pip install --find-links dist/ ...)"

$(STAMP): $(INPUTS)
	bash ci/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	$(UV) -r ci/requirements-test.txt -r ci/requirements-build.txt $(INSTALL)
	$(UV) --no-build-isolation $(INSTALL_NO_ISOLATION)
	rm -rf $(EXAMPLES_SITE)
	$(BIN)/python -c 'import numpy; print("numpy==" + numpy.__version__)' > $(VENV)/numpy-pin.txt
	$(UV) --target $(EXAMPLES_SITE) -r ci/requirements-examples.txt -c $(VENV)/numpy-pin.txt
	rm -rf $(EXAMPLES_SITE)/numpy $(EXAMPLES_SITE)/numpy-*.dist-info $(EXAMPLES_SITE)/numpy.libs \
	    $(EXAMPLES_SITE)/bin
	touch $@

setup: $(STAMP)

# tnt run keeps TensorFlow's C++ start-up lines out of the job's output (--log-level DEBUG
# shows them; docs/cli.md); TF_CPP_MIN_LOG_LEVEL=2 hides TensorFlow's C++ warnings, here the
# graph optimizer's "Not handling type DT_DOUBLE" of the float64 model
run: setup
	TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH=$(EXAMPLES_SITE) $(BIN)/tnt run -n $(NP) -- \
	    examples/quickstart/lenet5.py --compare-serial

test: setup
	bash ci/test.sh

tox: setup
	$(BIN)/tox

docs: setup
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: setup
	$(BIN)/python benchmarks/allreduce.py --backend gloo
	$(BIN)/python benchmarks/allreduce.py --backend mpi

# Gloo is built from Debian's source package and linked into tnt-comm-gloo's wheel; builds
# are cached by source hash (ci/build-wheels.sh says where and how)
wheels:
	bash ci/install-system-deps.sh
	bash ci/build-wheels.sh

clean:
	rm -rf $(VENV) .tox docs/_build dist build/wheel-tools
