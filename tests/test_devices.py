"""Tuning tables per device and dtype (csrc_free_ops.devices): the files the sweeps write, the
lookups the launchers make, and the rules derived from the device where a table has no entry."""
import json
from types import SimpleNamespace

import pytest
import torch

from csrc_free_ops import attention, devices, fp8, fused_decode, linear, moe

CONFIG_TYPES = {"linear_decode": (linear.DecodeConfig, 2), "linear_prefill": (linear.PrefillConfig, 3),
                "fused_decode": (fused_decode.GemvConfig, 3), "moe": (moe.MoeConfig, 3),
                "attention_forward": (attention.Tiles, 1), "fp8_prefill": (fp8.PrefillTiles, 2)}
"""Each table's config type and key length (the module doc of devices)."""


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A CUDA device named "Test GPU" of 66 SMs, its tables under tmp_path; cuda:0 is that device."""
    monkeypatch.setattr(devices, "TUNING_DIR", tmp_path)
    monkeypatch.setattr(devices, "cuda_properties", lambda device: SimpleNamespace(name="Test GPU",
                                                                                   multi_processor_count=66))
    monkeypatch.setattr(devices, "_tables", {})
    return torch.device("cuda", 0)


def test_shipped_files_hold_well_formed_tables():
    """Every shipped file names its device as its file name does, and every entry has its table's
    key length and builds its config type (a moe entry: buckets of configs); the prefill tables'
    M classes are linear's."""
    files = sorted(devices.TUNING_DIR.glob("*.json"))
    assert {f.stem for f in files} >= {"NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"}
    for path in files:
        data = json.loads(path.read_text())
        assert data["device"].replace(" ", "_") == path.stem
        assert devices._dumps(data) == path.read_text(), f"{path.name} is not in record's format"
        for table, by_dtype in devices._load(path.stem).items():
            kind, key_length = CONFIG_TYPES[table]
            for dtype, entries in by_dtype.items():
                assert isinstance(dtype, torch.dtype)
                for key, config in entries.items():
                    assert len(key) == key_length, (path.name, table, key)
                    for c in config.values() if table == "moe" else [config]:
                        assert kind(*c) == tuple(c)
                    if table == "linear_prefill":
                        assert key[0] in linear.PREFILL_M_CLASSES


def test_record_then_tuned(fake_gpu):
    """A sweep's entries, recorded, are what the launchers look up on that device and dtype, merged
    with what the file held; another dtype, another shape and the CPU get None."""
    path = devices.record("linear_decode", "Test GPU", torch.bfloat16, {(1024, 2048): linear.DecodeConfig(32, 128, 4)})
    assert path.name == "Test_GPU.json"
    devices.record("linear_decode", "Test GPU", torch.bfloat16, {(896, 1024): (32, 256, 1)})
    devices.record("moe", "Test GPU", torch.bfloat16, {(128, 1536, 2048): {16: (16, 128, 128, 1, 4, 3),
                                                                             4096: (128, 128, 64, 8, 8, 4)}})
    assert devices.tuned("linear_decode", fake_gpu, torch.bfloat16, (1024, 2048)) == [32, 128, 4, 4, 4]
    assert devices.tuned("linear_decode", fake_gpu, torch.bfloat16, (896, 1024)) == [32, 256, 1]
    assert devices.tuned("moe", fake_gpu, torch.bfloat16, (128, 1536, 2048)) == {16: [16, 128, 128, 1, 4, 3],
                                                                                  4096: [128, 128, 64, 8, 8, 4]}
    assert devices.tuned("linear_decode", fake_gpu, torch.float16, (1024, 2048)) is None
    assert devices.tuned("linear_decode", fake_gpu, torch.bfloat16, (1024, 3072)) is None
    assert devices.tuned("fused_decode", fake_gpu, torch.bfloat16, ("norm_linear", 1024, 2048)) is None
    assert devices.tuned("linear_decode", torch.device("cpu"), torch.bfloat16, (1024, 2048)) is None


def test_launchers_take_the_stored_config_else_the_rule_of_the_device(fake_gpu):
    """With an entry, the launcher's config is the stored one; without, the rule's K split aims
    for two programs per SM of this device (132 programs on 66 SMs), not for another GPU's count."""
    assert devices.target_programs(fake_gpu) == 132
    assert devices.target_programs(torch.device("cpu")) == devices.INTERPRETER_PROGRAMS
    devices.record("linear_decode", "Test GPU", torch.bfloat16, {(1024, 2048): (32, 128, 4)})
    devices.record("fused_decode", "Test GPU", torch.bfloat16, {("linear_residual", 1024, 2048): (32, 128, 8)})
    devices.record("moe", "Test GPU", torch.bfloat16, {(128, 1536, 2048): {16: (16, 128, 128, 1, 4, 3),
                                                                             4096: (128, 128, 64, 8, 8, 4)}})
    bf16 = torch.bfloat16
    assert linear.decode_config(1024, 2048, fake_gpu, bf16) == linear.DecodeConfig(32, 128, 4)
    # the rule: 64-wide tiles, 128-deep K steps; 1024 columns are 16 tiles, so 132 / 16 -> 9 slices
    assert linear.decode_config(1024, 3072, fake_gpu, bf16) == linear.DecodeConfig(64, 128, 9)
    assert fused_decode.gemv_config("linear_residual", 1024, 2048, fake_gpu, bf16) == fused_decode.GemvConfig(32, 128, 8)
    # FP8 weights: x's dtype's entry until an FP8 one is recorded (bench.fused_decode --sweep --fp8)
    assert fused_decode.gemv_config("linear_residual", 1024, 2048, fake_gpu, bf16, fp8=True) == (32, 128, 8, 4, 3)
    devices.record("fused_decode", "Test GPU", torch.float8_e4m3fn, {("linear_residual", 1024, 2048): (128, 128, 4)})
    assert fused_decode.gemv_config("linear_residual", 1024, 2048, fake_gpu, bf16, fp8=True) == (128, 128, 4, 4, 3)
    assert fused_decode.gemv_config("linear_residual", 1024, 2048, fake_gpu, bf16) == (32, 128, 8, 4, 3)
    assert moe.moe_config(8, 128, 1536, 2048, 8, fake_gpu, bf16) == moe.MoeConfig(16, 128, 128, 1, 4, 3)
    assert moe.moe_config(1000, 128, 1536, 2048, 8, fake_gpu, bf16) == moe.MoeConfig(128, 128, 64, 8, 8, 4)
    assert moe.moe_config(99999, 128, 1536, 2048, 8, fake_gpu, bf16) == moe.MoeConfig(128, 128, 64, 8, 8, 4)
    assert moe.moe_config(8, 128, 2048, 768, 8, fake_gpu, bf16) == moe.default_config(8, 128, 2048, 768, 8, 2)


def test_shared_memory_per_block_reads_what_the_build_has(monkeypatch):
    """The opt-in limit where the properties have it (CUDA), the default per-block limit where they
    do not (ROCm builds), None where neither is known: launchers then keep their tiles."""
    for props, expected in ((SimpleNamespace(shared_memory_per_block_optin=232448, shared_memory_per_block=49152), 232448),
                            (SimpleNamespace(shared_memory_per_block=65536), 65536), (SimpleNamespace(), None)):
        monkeypatch.setattr(devices, "cuda_properties", lambda device, p=props: p)
        assert devices.shared_memory_per_block(torch.device("cuda")) == expected
