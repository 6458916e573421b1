# make setup: .venv with fanrun built and installed; make demo: the DDP job; make test: every C++ and Python test;
# make wheel: dist/fanrun-<version>-*-manylinux_2_28_*.whl, built as a user's pip builds it, then repaired.
PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
INSTALLED := $(VENV)/.fanrun-installed
SOURCES := $(shell find cpp src -type f -not -name '*.pyc') CMakeLists.txt pyproject.toml
# The engine's tests: warnings are errors, AddressSanitizer and UndefinedBehaviorSanitizer on.
CPP_TEST_BUILD := build/cpp-tests
# libcurl, the engine's HTTP client, comes from Debian's package, installed before anything builds.
# benchmarks/slurm.py's smoke run (in test-python) and tests/slurm start a two-node Slurm here.
NEED_SLURM = dpkg -s slurmd munge >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq slurm-wlm munge)
NEED_LIBCURL = @dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libcurl4-openssl-dev)

.PHONY: setup demo test test-cpp test-python test-slurm wheel clean

setup: $(INSTALLED)

# pip 25.1 is the first to install a dependency group (--group) alone.
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=25.1"

# The test group's packages install the normal way, each sdist built in an isolated
# environment with the build tools it declares, so nothing depends on what .venv or pip's
# cache happens to hold. fanrun itself is built without isolation, so that build/ is reused
# between installs: its build tools come into .venv first, with a setuptools and wheel that
# can build any sdist among its own dependencies the same way.
$(INSTALLED): $(PY) $(SOURCES)
	$(NEED_LIBCURL)
	$(PY) -m pip install --quiet --group test
	$(PY) -m pip install --quiet "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja "setuptools>=70" wheel
	$(PY) -m pip install --quiet --no-build-isolation \
		--config-settings=cmake.define.FANRUN_WERROR=ON .
	touch $@

demo: setup
	$(PY) examples/ddp_demo.py

test: test-cpp test-python test-slurm

# GoogleTest comes from Debian's package; CMake cannot download anything here.
test-cpp: setup
	@dpkg -s libgtest-dev >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libgtest-dev)
	PATH="$(BIN):$$PATH" cmake -S . -B $(CPP_TEST_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Debug \
		-DFANRUN_BUILD_TESTS=ON -DFANRUN_WERROR=ON -DFANRUN_SANITIZE=ON
	PATH="$(BIN):$$PATH" cmake --build $(CPP_TEST_BUILD)
	cd $(CPP_TEST_BUILD) && PATH="$(BIN):$$PATH" ctest --output-on-failure -j2

# nginx serves the remote source of the data tests, Chromium renders the live panel as a person
# sees it, tmux holds the terminal its test reads: Debian's packages, like GoogleTest.
# The Ray tests run in a network namespace of their own, with loopback alone (tests/ray/netns.py);
# the Slurm tests run from test-slurm (Debian's slurm-wlm and munge, installed here for benchmarks/slurm.py too).
test-python: setup
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || (apt-get update -qq && apt-get install -y -qq nginx-light)
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium)
	@command -v tmux >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq tmux)
	@$(NEED_SLURM)
	$(PY) -m pytest tests --ignore=tests/ray --ignore=tests/slurm --durations=15
	$(PY) tests/ray/netns.py $(PY) -m pytest tests/ray --durations=5

# A real two-node Slurm cluster on this machine (tests/slurm/cluster.py), from Debian's packages,
# in a network namespace of its own with loopback alone, as for the Ray tests.
test-slurm: setup
	@$(NEED_SLURM)
	$(PY) tests/ray/netns.py $(PY) -m pytest tests/slurm --durations=5

# The wheels users install: cp311, and one abi3 wheel for Python 3.12 on where such a Python is
# here (ABI3_PYTHON names it), each tagged manylinux_2_28 with libcurl inside
# (packaging/manylinux_wheels.sh says how; no root, nothing from apt installed). WHEEL_DIR moves them.
WHEEL_DIR ?= dist
ABI3_PYTHON ?= $(firstword $(shell command -v python3.14 python3.13 python3.12 2>/dev/null))
wheel:
	sh packaging/manylinux_wheels.sh "$(WHEEL_DIR)" "$(PYTHON)" "$(ABI3_PYTHON)"

clean:
	rm -rf build dist $(VENV)
