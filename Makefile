# Every target creates .venv with the pinned packages first if it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export TORCHDYNAMO_DISABLE ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-faults test-megatron-lm plan bench clean

# Megatron-LM's own loop (megatron.training) ships in megatron-core >= 0.17 wheels, which need Python 3.12.
# PY312: the first interpreter that really is 3.12 (pyenv's shim named python3.12 refuses unless pyenv
# selects 3.12, so pyenv's versions folder is tried first).
MLM_VENV := .venv-mlm
MLM_PY := $(MLM_VENV)/bin/python
PY312 ?= $(shell for p in $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 \
	/usr/bin/python3.12 python3.12; do "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
	>/dev/null 2>&1 && { echo "$$p"; break; }; done)

$(VENV)/.installed: requirements.txt setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -r requirements.txt
	$(VPY) -m pip install --quiet --no-deps -e .
	touch $@

.venv: $(VENV)/.installed

# The demo: profile the tiny Multitask-CLIP on this machine (every point measured again: points cached on another
# day, under another load, would make the prediction lines compare today's steps with that day's), then train
# it for 30 steps on DEMO_RANKS CPU ranks (default: one per core, 2 to 4) with the plan made from those
# curves. Profile and training use the same ranks: processes that share cores slow each other down, which a
# profile of fewer processes does not see (a GPU machine trains the full model: scripts/run_multitask_clip.sh).
DEMO_RANKS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; [ $$n -gt 4 ] && n=4; echo $$n)
demo: $(VENV)/.installed
	$(VENV)/bin/spindle profile --model multitask-clip --tasks 4 --size tiny --batch $$((4 * $(DEMO_RANKS))) \
		--nproc $(DEMO_RANKS) --max-devices $(DEMO_RANKS) --gpus-per-node $(DEMO_RANKS) \
		--out out/curves_tiny.json --quiet --fresh
	GPUS_PER_NODE=$(DEMO_RANKS) PYTHON=$(VPY) scripts/run_multitask_clip.sh --spindle-curves out/curves_tiny.json

# Whole runs as a user starts them, with faults: their own target, so each suite stays well under 15 minutes
# on 2 cores (their times: tests/README.md).
FAULT_TESTS := tests/test_launch_path.py tests/test_faults_kill.py tests/test_faults_checkpoint.py tests/test_bad_input.py \
	tests/test_faults_files.py tests/test_mimo_launch.py tests/test_mimo_script.py

test: $(VENV)/.installed
	$(VPY) -m pytest -q tests $(addprefix --ignore=,$(FAULT_TESTS))

test-faults: $(VENV)/.installed
	$(VPY) -m pytest -q $(FAULT_TESTS)

$(MLM_VENV)/.installed: requirements-mlm.txt setup.py
	@test -n "$(PY312)" || { echo "error: no Python 3.12 found (tried pyenv's versions/3.12*, /usr/local/bin, /usr/bin, PATH); set PY312=/path/to/python3.12" >&2; exit 2; }
	test -x $(MLM_PY) || $(PY312) -m venv $(MLM_VENV)
	$(MLM_PY) -m pip install --quiet --upgrade pip
	$(MLM_PY) -m pip install --quiet -r requirements-mlm.txt
	$(MLM_PY) -m pip install --quiet --no-deps -e .
	touch $@

# Megatron-LM's pretrain through our hooks on gloo CPU ranks (megatron-core 0.19.2, Python 3.12), plus the
# tests that involve megatron.core directly, so the newest megatron-core line runs them too (a user's MIMO model:
# its API differs between the lines).
test-megatron-lm: $(MLM_VENV)/.installed
	$(MLM_PY) -m pytest -q tests/test_megatron_lm.py tests/test_megatron_flags.py tests/test_frozen_megatron_lm.py tests/test_megatron_hooks.py \
		tests/test_megatron_backend.py tests/test_layers.py tests/test_comm_discipline.py tests/test_bf16.py tests/test_gpu_check_script.py \
		tests/test_gpu_node.py tests/test_launch_megatron_lm.py tests/test_mimo_megatron_lm.py tests/test_mimo_runtime.py tests/test_mimo_model.py \
		tests/test_flag_contract.py tests/test_mimo_checkpoint.py

clean:
	rm -rf $(VENV) $(MLM_VENV) out
