# Every target installs what it needs into .venv first (torch CPU wheel pinned before anything
# else pulls a CUDA build). `make demo` and `make test` are the whole set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.tierckpt-installed
# torchtitan for its integration's tests, without its data/logging dependencies (datasets<4.8
# would downgrade huggingface_hub under transformers); the checkpointer needs only these.
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 \
	typeguard==4.6.1

# Azure's Blob Storage emulator for the az:// tests (tests/azureserver.py), from npm into the
# venv (.venv/node/node_modules/.bin/azurite-blob); node and npm come from the system.
AZURITE := azurite@3.37.0

# The newest torch pyproject admits, in a venv of its own: `make test-torch-next`.
TORCH_NEXT ?= 2.14.1
VENV_NEXT := .venv-next

.PHONY: demo test test-fast test-fence test-torch-next lint bench docs venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps $(TORCHTITAN)
	npm install --prefix $(VENV)/node --no-audit --no-fund --silent $(AZURITE)
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tierckpt.cli.demo

# Everything, slow tests included (what CI runs), in three pytests side by side: the tests
# marked `timers` (tests/conftest.py TIMERS: the scheduler tests, waiting on slurmctld), those
# marked `beside` (BESIDE: tier 2 against its servers, notices, watchdogs — they mostly wait
# on timers and servers) and the CPU-bound rest. The other lanes' logs (build/test-*.log)
# are printed after the first one's, and any lane failing fails the target. pytest's default
# options (pyproject addopts) print the 25 slowest tests of each lane; every test's time is
# in build/test-{main,beside,timers}.xml (JUnit XML), for rebalancing the lanes.
PYTEST_LANE = $(BIN)/python -m pytest -q -p no:cacheprovider
test: $(STAMP)
	@mkdir -p build
	@$(PYTEST_LANE) -m timers --junitxml=build/test-timers.xml > build/test-timers.log 2>&1 & \
	timers=$$!; \
	$(PYTEST_LANE) -m "beside and not timers" --junitxml=build/test-beside.xml \
		> build/test-beside.log 2>&1 & \
	beside=$$!; trap 'kill $$timers $$beside 2>/dev/null' INT TERM; \
	$(PYTEST_LANE) -m "not beside and not timers" --junitxml=build/test-main.xml; main=$$?; \
	wait $$beside; beside=$$?; wait $$timers; timers=$$?; \
	echo "==== the tests marked beside, run beside the rest (build/test-beside.log) ===="; \
	cat build/test-beside.log; \
	echo "==== the tests marked timers, run beside the rest (build/test-timers.log) ===="; \
	cat build/test-timers.log; \
	test $$main -eq 0 && test $$beside -eq 0 && test $$timers -eq 0

# The edit-test loop: everything but the tests marked `slow`, in two pytests side by side
# as `make test` runs them (those marked `beside` mostly wait on servers and timers): on
# 2 cores 2:56 where one pytest took 4:38. The second lane's log (build/test-fast-beside.log)
# is printed after the first's; either failing fails the target.
test-fast: $(STAMP)
	@mkdir -p build
	@$(PYTEST_LANE) -m "not slow and beside" > build/test-fast-beside.log 2>&1 & \
	beside=$$!; trap 'kill $$beside 2>/dev/null' INT TERM; \
	$(PYTEST_LANE) -m "not slow and not beside"; main=$$?; \
	wait $$beside; beside=$$?; \
	echo "==== the tests marked beside, run beside the rest (build/test-fast-beside.log) ===="; \
	cat build/test-fast-beside.log; \
	test $$main -eq 0 && test $$beside -eq 0

# What each torch in tierckpt._torch.TESTED must pass besides the release the suite runs on:
# the fast suite and the slow tests through torch internals (marked `fence`).
test-fence: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow or fence"

test-torch-next:
	$(MAKE) --no-print-directory VENV=$(VENV_NEXT) TORCH_VERSION=$(TORCH_NEXT) test-fence

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench
	$(BIN)/mypy

# The API reference (pdoc, from the docstrings of everything in tierckpt.__all__) into
# build/api (git-ignored); fails on a pdoc warning, a missing docstring or a broken reference.
docs: $(STAMP)
	$(BIN)/python docs/api/build.py build/api

bench: $(STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_NEXT) build *.egg-info src/*.egg-info
