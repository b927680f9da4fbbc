# The two set-up commands of the README: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
DEMO_OUT ?= demo-out

.PHONY: demo test lint install install-test slurm-install bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# login-node install: CLI, simulator, planner (no torch)
$(VENV)/.installed: setup.cfg pyproject.toml | $(VENV)/bin/python
	$(PIP) install -e .
	touch $@

# everything: runtime (torch 2.13.0 CPU wheel, megatron-core 0.16.1), DeepSpeed (built without ops: none is
# compiled on the CPU; torch stays pinned so it keeps the CPU wheel) and test tools. torch is pinned first:
# the extra's range would otherwise let pip pick a newer, several-GB CUDA build
$(VENV)/.installed-test: setup.cfg pyproject.toml | $(VENV)/bin/python
	$(PIP) install torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -e '.[runtime,test,deepspeed]' torch==2.13.0
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# the main job on embedded defaults: plan OPT-350M on the paper's A100 + V100 site; the job's dataset lives
# on that site's filesystem, not here (--skip-path-check)
demo: $(VENV)/.installed
	$(VENV)/bin/sailor-hpc site show site_configs/a100-v100.toml
	$(VENV)/bin/sailor-hpc plan --site site_configs/a100-v100.toml --model OPT-350M --gbs 1024 \
		-o $(DEMO_OUT)/plan.json --sbatch $(DEMO_OUT)/train.sbatch --skip-path-check \
		--data $(CURDIR)/$(DEMO_OUT)/data/tokens --save $(CURDIR)/$(DEMO_OUT)/checkpoints
	@echo "--- $(DEMO_OUT)/train.sbatch (head)"; head -n 30 $(DEMO_OUT)/train.sbatch

# Installs Debian's Slurm (root) so the tests can start a real local cluster; then the whole suite, a file per
# worker (pytest-xdist --dist loadfile keeps a file's tests and module fixtures on one worker; every worker
# starts its own lab, with its own ports and job ids: tests/slurm/cluster.py). TEST_WORKERS=1 runs it serially.
# Bytecode is written (PYTHONDONTWRITEBYTECODE unset): every rank and CLI process imports the project afresh.
TEST_WORKERS ?= 3
test: $(VENV)/.installed-test
	-bash tests/slurm/install.sh
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q --durations=20 $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) tests

# style and types (CI runs it before the tests): ruff everywhere, mypy on every package (the runtime and
# profiler included: torch's types come from the test install; megatron-core and DeepSpeed have none)
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(VENV)/.installed-test
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_OUT)
