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

# The demo: profile the tiny Multitask-CLIP on this machine (cached after the first run), then train it
# for 30 steps on 4 CPU ranks with the plan made from those curves (a GPU machine trains the full model).
demo: $(VENV)/.installed
	$(VENV)/bin/spindle profile --model multitask-clip --tasks 4 --size tiny --batch 16 --nproc 2 \
		--max-devices 4 --gpus-per-node 4 --out out/curves_tiny.json --quiet
	PYTHON=$(VPY) scripts/run_multitask_clip.sh --spindle-curves out/curves_tiny.json

test: $(VENV)/.installed
	$(VPY) -m pytest -q tests

clean:
	rm -rf $(VENV) out
