# make setup: .venv with fanrun built and installed; make demo: the DDP job; make test: every C++ and Python test.
PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
INSTALLED := $(VENV)/.fanrun-installed
SOURCES := $(shell find cpp src -type f -not -name '*.pyc') CMakeLists.txt pyproject.toml
# The engine's tests: warnings are errors, AddressSanitizer and UndefinedBehaviorSanitizer on.
CPP_TEST_BUILD := build/cpp-tests

.PHONY: setup demo test test-cpp test-python clean

setup: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Built without build isolation so that build/ is reused between installs; the build
# tools come from PyPI into .venv, like everything else.
$(INSTALLED): $(PY) $(SOURCES)
	$(PY) -m pip install --quiet "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja
	$(PY) -m pip install --quiet --no-build-isolation \
		--config-settings=cmake.define.FANRUN_WERROR=ON ".[test]"
	touch $@

demo: setup
	$(PY) examples/ddp_demo.py

test: test-cpp test-python

# GoogleTest comes from Debian's package; CMake cannot download anything here.
test-cpp: setup
	@dpkg -s libgtest-dev >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libgtest-dev)
	PATH="$(BIN):$$PATH" cmake -S . -B $(CPP_TEST_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Debug \
		-DFANRUN_BUILD_TESTS=ON -DFANRUN_WERROR=ON -DFANRUN_SANITIZE=ON
	PATH="$(BIN):$$PATH" cmake --build $(CPP_TEST_BUILD)
	cd $(CPP_TEST_BUILD) && PATH="$(BIN):$$PATH" ctest --output-on-failure -j2

# nginx serves the remote source of the data tests; Debian's package, like GoogleTest's.
test-python: setup
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || (apt-get update -qq && apt-get install -y -qq nginx-light)
	$(PY) -m pytest tests

clean:
	rm -rf build $(VENV)
