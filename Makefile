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

# the main job on embedded defaults: plan OPT-350M on the paper's A100 + V100 site with only 64 of its 256 A100s
# free (with all of them free, A100s alone are fastest: every pipeline waits for the slowest), draw the plan's
# charts, show the job script's header and command (the rank layout's comment, a number per rank, shortened) and
# say how to read and use it all. The job's dataset lives on that site's filesystem, not here (--skip-path-check).
DEMO_STEPS ?= 1000
DEMO_DIR = $(abspath $(DEMO_OUT))
DEMO_SITE = site_configs/a100-v100.toml
SAILOR = $(VENV)/bin/sailor-hpc
demo: $(VENV)/.installed
	$(SAILOR) site show $(DEMO_SITE)
	@echo "--- 64 of the 256 A100s are free (--available): the planner fills in with V100s"
	$(SAILOR) plan --site $(DEMO_SITE) --model OPT-350M --gbs 1024 --available a100=64,v100=256 \
		--steps $(DEMO_STEPS) -o $(DEMO_OUT)/plan.json --pareto $(DEMO_OUT)/front.png \
		--sbatch $(DEMO_OUT)/train.sbatch --skip-path-check --data $(DEMO_DIR)/data/tokens --save $(DEMO_DIR)/checkpoints
	$(SAILOR) simulate $(DEMO_OUT)/plan.json --site $(DEMO_SITE) --timeline $(DEMO_OUT)/timeline.png \
		--json > $(DEMO_OUT)/simulate.json
	@echo "--- $(DEMO_OUT)/train.sbatch: its header and the training command (long comments shortened)"
	@awk 'function short(s,  n, w, i, h, t) { n = split(s, w, " "); for (i = 1; length(h) + length(w[i]) < 90; i++) \
		h = h w[i] " "; for (; n > i && length(t) + length(w[n]) < 25; n--) t = " " w[n] t; return h "..." t } \
		/^set -uo pipefail/ { body = 1; print "..."; next } \
		!body || /^LAUNCH=/ { print (/^# / && length($$0) > 120 ? short($$0) : $$0) }' $(DEMO_OUT)/train.sbatch
	@echo "--- reading the plan table"
	@echo "  GPUs        what the job asks Slurm for, by GPU type; vs #1: time and cost against the best plan"
	@echo "  pipelines   Nx: N copies (data-parallel replicas) of the pipeline shape on that line"
	@echo "  stages      GPU type, TP (GPUs per tensor-parallel group) and layers of each stage; stages of one type"
	@echo "              and TP in a row are grouped: 'V100-16 TP2 0-12,13-25' is two TP-2 stages, layers 0-12 and"
	@echo "              13-25 (layer 0: embedding; the last: final norm and LM head)"
	@echo "  mbs x micro-batches   micro-batch size x micro-batches of each copy per iteration (a range: the"
	@echo "              batch's remainder spread over some copies)"
	@echo "  plans whose iteration times print alike (4 digits) are tied: fewer GPUs first, then the cheaper"
	@echo "--- next"
	@echo "  charts:   $(DEMO_OUT)/front.png (cost vs throughput of every allocation scored),"
	@echo "            $(DEMO_OUT)/timeline.png (one iteration, rank by rank; sailor-hpc simulate PLAN --timeline)"
	@echo "  submit:   sbatch $(DEMO_OUT)/train.sbatch   (on the site; $(DEMO_STEPS) steps, from --steps)"
	@echo "            or: $(SAILOR) submit $(DEMO_OUT)/plan.json --site $(DEMO_SITE) --data PREFIX --save DIR --steps N"
	@echo "  run:      $(SAILOR) run --site $(DEMO_SITE) --model OPT-350M --data PREFIX --save DIR --steps N"
	@echo "            (plans on the GPUs free now, re-plans and resumes as they change: docs/controller.md)"
	@echo "  more:     docs/cli.md (every command), docs/planner.md (how the plans are found)"

# Installs Debian's Slurm (root) so the tests can start a real local cluster; then the whole suite, a file per
# worker (pytest-xdist --dist loadfile keeps a file's tests and module fixtures on one worker; every worker
# starts its own lab, with its own ports and job ids: tests/slurm/cluster.py). Of the 4 workers, the last runs only
# the files that wait on Slurm's clock (tests/longest_first.py); the labs' job ranks fork from a zygote
# (megatron_patch/fork_server.py). TEST_WORKERS=1 runs it serially.
# Bytecode is written (PYTHONDONTWRITEBYTECODE unset): every rank and CLI process imports the project afresh.
TEST_WORKERS ?= 4
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
