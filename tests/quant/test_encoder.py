"""The MXFP4 kernel and its admission: it matches the specification and Quark, it runs only with a proof,
the proof can fail, and the choice never changes a byte of the export or a fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.checkpoints import fp8
from pipeline.errors import BadInputError, EncoderMismatchError, ExternalError
from pipeline.quant import mxfp4
from pipeline.quant.admission import choose_encoder
from pipeline.quant.encoder import KernelEncoder, QuarkEncoder
from pipeline.quant.proof import prove_kernel
from pipeline.quant.quark import quark_config


@pytest.fixture(scope="module")
def weight_config():
    return quark_config("qwen3_5", "mxfp4", []).global_quant_config.weight


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: no kernel build and no proof from elsewhere."""
    monkeypatch.setenv("MXSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _edge_weight(dtype: torch.dtype, top: float = 1.5e38) -> torch.Tensor:
    """Gaussian rows, plus blocks of zeros, ties, subnormals and values near `top`."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=generator) * 0.02
    weight[0, :32] = 0.0
    weight[1, :32] = torch.tensor(mxfp4.E2M1_VALUES.tolist() * 4) * torch.tensor([1.0, -1.0] * 16)
    weight[2, :32] = 2.0 ** -130  # a float32-subnormal block (bfloat16 keeps it too)
    weight[3, :32] = torch.tensor([top, -top, top / 2, -2e37] * 8)
    weight[4, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.9] * 4)  # every tie and the top
    return weight.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_the_specification_bytes(dtype):
    weight = _edge_weight(dtype)
    packed, scales = KernelEncoder().encode(weight)
    want_packed, want_scales = mxfp4.encode(weight.float().numpy())
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(packed.numpy(), want_packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_quarks_bytes(dtype, weight_config):
    # Past 1.75 * 2^127 Quark's in-memory freeze overflows to inf (the specification follows it there);
    # its file-to-file routine, which the kernel follows, packs the value it computed.
    weight = _edge_weight(dtype, top=3e38)
    ours, quark = KernelEncoder().encode(weight), QuarkEncoder(weight_config).encode(weight, "x.weight")
    assert torch.equal(ours[0], quark[0]) and torch.equal(ours[1], quark[1])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_the_kernel_refuses_a_non_finite_weight(bad):
    weight = torch.zeros(2, 64)
    weight[1, 40] = bad
    with pytest.raises(BadInputError, match="layers.0.q_proj.*inf or NaN"):
        KernelEncoder().encode(weight, "layers.0.q_proj.weight")


def test_the_kernel_dequantizes_fp8_as_the_reader_does():
    """One expert's up half of a fused gate_up weight: rows 96.. of 192, tiles of 128 rows straddled."""
    generator = torch.Generator().manual_seed(1)
    full = torch.randn(192, 256, generator=generator)
    codes, scale_inv = fp8.quantize(full, (128, 128))
    up = fp8.dequantize(codes, scale_inv, (128, 128))[96:]
    packed, scales = KernelEncoder().encode_fp8(codes[96:], scale_inv, (128, 128), first_row=96)
    want = KernelEncoder().encode(up.contiguous())
    assert torch.equal(packed, want[0]) and torch.equal(scales, want[1])


def test_the_bfloat16_proof_runs_once_and_is_kept(own_cache, weight_config):
    proof = prove_kernel("bfloat16", weight_config, say=lambda _: None)
    assert proof.inputs > 10_000_000 and proof.scales > 300_000 and proof.quark == "0.13"
    kept = list((own_cache / "proofs").glob("bfloat16-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["inputs"] == proof.inputs
    assert prove_kernel("bfloat16", weight_config) == proof  # from the cache


def test_a_process_that_finds_the_kernel_being_proven_waits_for_that_proof(own_cache, weight_config, monkeypatch):
    """Two runs sharing a cache (two pytest workers, Ray workers on one node) prove once: the second waits
    on the first's lock, says so, and reads the proof the first kept."""
    import fcntl
    import threading
    import time

    from pipeline.quant import proof as proof_module

    proof = prove_kernel("bfloat16", weight_config, say=lambda _: None)
    kept = next((own_cache / "proofs").glob("bfloat16-*.json"))
    made = kept.read_bytes()
    kept.unlink()
    monkeypatch.setattr(proof_module, "_prove", lambda *args: pytest.fail("proved again"))
    said, found = [], []
    with open(own_cache / "proofs.lock", "w") as other_prover:
        fcntl.flock(other_prover, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: found.append(prove_kernel("bfloat16", weight_config, said.append)))
        waiter.start()
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert said == ["  waiting for another process proving the MXFP4 kernel"] and waiter.is_alive()
        kept.write_bytes(made)  # the other process's proof lands, then its lock goes
    waiter.join(timeout=30)
    assert found == [proof]


def test_a_kernel_that_differs_from_quark_is_refused(own_cache, weight_config, monkeypatch):
    honest = KernelEncoder.encode

    def off_by_one_nibble(self, weight, name="weight"):
        packed, scales = honest(self, weight, name)
        packed[-1, -1] ^= 0x10
        return packed, scales

    monkeypatch.setattr(KernelEncoder, "encode", off_by_one_nibble)
    with pytest.raises(EncoderMismatchError, match="differs from Quark on 1 of"):
        prove_kernel("bfloat16", weight_config)
    assert not (own_cache / "proofs").exists()  # no proof is kept
    choice = choose_encoder("auto", {"bfloat16"}, weight_config)
    assert choice.name == "quark" and "differs from Quark" in choice.reason


def test_auto_takes_the_proven_kernel_and_falls_back_to_quark_without_a_compiler(own_cache, weight_config,
                                                                                 monkeypatch):
    choice = choose_encoder("auto", {"bfloat16"}, weight_config)
    assert (choice.name, choice.device) == ("kernel", "cpu") and "bfloat16: 10," in choice.proof
    assert choose_encoder("quark", {"bfloat16"}, weight_config).name == "quark"
    monkeypatch.setenv("CC", "/bin/false")  # another compiler is another build, which cannot be made
    fallback = choose_encoder("auto", {"bfloat16"}, weight_config)
    assert fallback.name == "quark" and "failed to build" in fallback.reason
    with pytest.raises(ExternalError, match="failed to build"):
        choose_encoder("kernel", {"bfloat16"}, weight_config)


def test_the_kernel_is_not_offered_for_another_scheme_or_dtype(own_cache):
    other = quark_config("qwen3_5", "mxfp6_e2m3", []).global_quant_config.weight
    assert choose_encoder("auto", {"bfloat16"}, other).name == "quark"
    with pytest.raises(BadInputError, match="implements fp4"):
        choose_encoder("kernel", {"bfloat16"}, other)
    with pytest.raises(BadInputError, match="not float16"):
        prove_kernel("float16", quark_config("qwen3_5", "mxfp4", []).global_quant_config.weight)


def test_the_encoder_is_not_part_of_the_quantize_fingerprint():
    from pipeline.recipe import Quantization, Recipe
    from pipeline.run.runner import recipe_hash

    base = Recipe.model_validate({"name": "n", "target": {"path": "/x"}, "drafter": {"path": "/y"}})
    other = base.model_copy(update={"quantization": Quantization(encoder="quark")})
    assert recipe_hash(base, "quantization") == recipe_hash(other, "quantization")
    changed = base.model_copy(update={"quantization": Quantization(quantize_mtp=True)})
    assert recipe_hash(base, "quantization") != recipe_hash(changed, "quantization")
