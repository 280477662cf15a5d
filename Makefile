# Every target creates .venv with the pinned packages first if it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export TORCHDYNAMO_DISABLE ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: demo test plan bench clean

$(VENV)/.installed: requirements.txt setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -r requirements.txt
	$(VPY) -m pip install --quiet --no-deps -e .
	touch $@

.venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/spindle plan --model multitask-clip --tasks 4 --gpus 16 --gantt out/plan.png --out out/plan.json

test: $(VENV)/.installed
	$(VPY) -m pytest -q tests

clean:
	rm -rf $(VENV) out
