# The two commands of the README:  `make demo`  and  `make test`.  Both set up .venv first when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One process per GPU when there are GPUs, else 2 CPU processes.
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [ "$${n:-0}" -gt 0 ] && echo $$n || echo 2)
# A quick subset of the tests: nothing that starts processes.
QUICK := not launch and not multiproc and not multihost and not faults and not slurm and not notebooks

.PHONY: setup demo test test-quick diffs lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -r requirements.txt
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) 02_torchrun.py

test: setup
	$(BIN)/pytest

test-quick: setup
	$(BIN)/pytest -m "$(QUICK)"

diffs: setup
	$(BIN)/python tools/make_diffs.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
