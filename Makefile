# The README's commands: `make demo` and `make test` (both set up .venv first when needed); `make test-long-job`
# runs the long-job ports (streamed data, timed steps, snapshots in the background), `make test-past-fsdp` those
# past FSDP (tensor parallelism, ZeRO-1), `make test-lessons` re-executes every lecture, `make test-exercises` runs each exercise's
# check on its solution, starter and shortcuts,
# `make test-root` runs the tests that need root, `make test-gpu` the GPU claims, and `make test-oldest` the scripts
# on the oldest supported torch (docs/versions.md). docs/ci.md has their times. `make check` grades the exercises.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OLDEST := .venv-oldest
# One process per GPU when there are GPUs, else 2 CPU processes.
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [ "$${n:-0}" -gt 0 ] && echo $$n || echo 2)
# On the oldest torch: the tests that launch the numbered scripts (each trains; 04 killed and resumed; the
# preemption path; 05 sharded, resharded and resumed) and the sbatch files on the local Slurm cluster (root;
# skipped without it). (The jobs run the torch of the pytest that submits them: tests/helpers.py, slurm_env.)
OLDEST_TESTS := tests/test_scripts_train.py tests/test_fault_tolerance.py tests/test_fsdp.py tests/test_slurm.py
# `make test` runs the tests in this many processes (pytest-xdist; tests/conftest.py says which share one).
JOBS ?= 2

# One target at a time, even under make -j: the test targets share the local Slurm cluster and the machine's cores.
.NOTPARALLEL:

.PHONY: setup python-check demo check check-setup test test-long-job test-past-fsdp test-lessons test-exercises test-quick test-root test-gpu test-oldest lock diffs lint clean

setup: $(VENV)/.installed

# The lock pins wheels for Python 3.11-3.13 (3.11 is the one tested); an older Python fails deep inside pip (3.10:
# contourpy 1.3.3 has no wheel for it), so say it in one line first. Checked only when a venv is to be made.
python-check:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; ok = (3, 11) <= v <= (3, 13); \
	ok or print(f"make setup: {sys.executable} is Python {v[0]}.{v[1]}; the lock needs Python 3.11 (tested) to 3.13:", \
	"install one, then run e.g. make setup PYTHON=python3.11", file=sys.stderr); sys.exit(not ok)'

# requirements.txt is the lock: exact versions of everything, generated from requirements.in (`make lock`).
$(VENV)/.installed: requirements.txt
	@$(MAKE) --no-print-directory python-check
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --no-cache-dir -r requirements.txt
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) 02_torchrun.py

# The exercises (exercises/README.md): `make check` lists them and your progress, `make check EX=NAME` grades one.
EX ?=
check: setup
	$(BIN)/python exercises/grade.py $(EX)

# A workshop's first ten minutes: the Python, the venv, a 2-process gloo all-reduce; one line each. It needs no venv
# to start (it says whether there is one), so it runs with the Python that would make one.
check-setup:
	@$(PYTHON) exercises/check_setup.py

# Every claim of the scripts, the port, the tools, the Slurm files and the preflight that needs neither root nor a
# GPU (those tests skip, saying why), and the fast checks of the committed notebooks: everything but the lectures'
# clean-kernel executions, which `make test-lessons` runs.
test: setup
	$(BIN)/pytest -n $(JOBS) --no-loadscope-reorder -m "not notebooks and not exercises and not long_job and not past_fsdp"

# The long-job ports run for real (port/gpt_stream.py, gpt_timed.py, gpt_async.py: a run stopped and resumed, killed
# mid-write, a rank slowed): kept out of `make test`, which is at its time budget (docs/ci.md).
test-long-job: setup
	$(BIN)/pytest -n $(JOBS) --no-loadscope-reorder -m long_job

# The ports past FSDP run for real (port/gpt_tp.py: a 2 x 2 grid stopped and resumed on one row, against one process
# and 1-D FSDP2; port/gpt_zero.py against gpt_ddp.py; port/gpt_pp.py on 4 stages, then 2, against one process): kept
# out of `make test`, which is at its time budget.
test-past-fsdp: setup
	$(BIN)/pytest -n $(JOBS) --no-loadscope-reorder -m past_fsdp

# Every exercise's check run on its solution (passes), its starter and its forbidden shortcuts (fail as expected).
test-exercises: setup
	$(BIN)/pytest -n $(JOBS) --no-loadscope-reorder -m exercises

# Every lecture re-executed from a clean kernel (its asserts check its prose against its outputs); making_ddp_fast's
# live shaped link needs root (`make test-root` runs it).
test-lessons: setup
	$(BIN)/pytest -n $(JOBS) --no-loadscope-reorder -m notebooks

# A quick subset of the tests: nothing that starts processes (the `quick` marker: tests/conftest.py).
test-quick: setup
	$(BIN)/pytest -m quick

# What an ordinary user's `make test` skips: network-namespace hosts, the local Slurm cluster, notebook making_ddp_fast's
# live shaped link. Run as root: sudo -E make test-root
test-root: setup
	$(BIN)/pytest -m root

# The GPU check (tools/gpu_check.py, docs/tests.md): the `gpu` tests and the GPU benchmark, run with the Python
# given (a GPU machine's own: no venv, nothing installed), a log and a JSON report written into OUT. Without CUDA
# every test skips, saying why, and it exits 0 (CI runs it so): make test-gpu PYTHON=.venv/bin/python
OUT ?= gpu-check
test-gpu:
	$(PYTHON) tools/gpu_check.py --out $(OUT)

$(OLDEST)/.installed: requirements-oldest.txt
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --disable-pip-version-check --no-cache-dir -r requirements-oldest.txt
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/pytest $(OLDEST_TESTS)

# Regenerates both locks from their .in files (a maintainer's step: docs/versions.md, "Moving the pin").
lock: setup
	$(BIN)/pip install --disable-pip-version-check --quiet uv
	$(BIN)/uv pip compile --quiet --universal --python-version 3.11 requirements.in -o requirements.txt
	$(BIN)/uv pip compile --quiet --universal --python-version 3.11 requirements-oldest.in -o requirements-oldest.txt

diffs: setup
	$(BIN)/python tools/make_diffs.py

lint: setup
	$(BIN)/ruff check .

# (.venv-oldest-fsdp: the second old venv, until 2026-11-26)
clean:
	rm -rf $(VENV) $(OLDEST) .venv-oldest-fsdp .pytest_cache .ruff_cache
