"""Checkpoint loading errors: each names the offending tensor, file or model_type."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modeling import CheckpointError, ConfigError, QwenConfig, QwenForCausalLM
from modeling.model.files import SIDE_FILE_LIMIT, read_file
from modeling.model.loader import INDEX_FILE, load_plan
from modeling.model.random_checkpoint import MARKER, build_random_checkpoint
from tests.helpers import isolated, needs_fifo

CONFIG = dict(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)


def hf_tensors(config: dict) -> dict:
    """Random tensors under the Hugging Face names and shapes the config calls for."""
    plan = load_plan(QwenConfig.from_dict(config))
    return {name: torch.randn(shape) for sources in plan.values() for name, shape in sources}


def write_checkpoint(path, config: dict, tensors: dict):
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_valid_checkpoint_loads(tmp_path):
    tensors = hf_tensors(CONFIG)
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors), dtype=torch.float32)
    assert torch.equal(model.lm_head, tensors["lm_head.weight"])
    assert torch.equal(model.layers[0].o_weight, tensors["model.layers.0.self_attn.o_proj.weight"])


def test_tied_checkpoint_with_lm_head_is_accepted(tmp_path):
    config = CONFIG | {"tie_word_embeddings": True}
    tensors = hf_tensors(config) | {"lm_head.weight": torch.randn(64, 32)}
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, tensors), dtype=torch.float32)
    assert model.lm_head is None


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.v_proj.bias", "lm_head.weight"])
def test_missing_tensor(tmp_path, name):
    tensors = hf_tensors(CONFIG)
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_qwen3_norms_missing_from_qwen2_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.0\.self_attn\.k_norm\.weight"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG | {"model_type": "qwen3"}, hf_tensors(CONFIG)))


def test_unexpected_tensor(tmp_path):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    tensors = hf_tensors(CONFIG) | {name: torch.randn(8)}
    with pytest.raises(CheckpointError, match=f"unexpected tensor.*{name}"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_wrong_shape(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors = hf_tensors(CONFIG) | {name: torch.randn(64, 32)}
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \[64, 32\], the config expects \[32, 32\]"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_missing_shard(tmp_path):
    tensors = hf_tensors(CONFIG)
    write_checkpoint(tmp_path, CONFIG, tensors)
    weight_map = {name: "model.safetensors" for name in tensors} | {"lm_head.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_unsupported_model_type(tmp_path):
    config = CONFIG | {"model_type": "llama"}
    with pytest.raises(ConfigError, match="unsupported model_type 'llama': supported are qwen3, qwen2, qwen3_moe, qwen2_moe, qwen3_5_text"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, {}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/model.safetensors"])
def test_index_shards_must_lie_inside_the_checkpoint(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = hf_tensors(CONFIG)
    write_checkpoint(ckpt, CONFIG, tensors)
    save_file(tensors, str(tmp_path / "outside.safetensors"))  # a readable file the index points at
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in tensors}}))
    with pytest.raises(CheckpointError, match="shards must be file names inside the checkpoint directory"):
        QwenForCausalLM.from_pretrained(ckpt)


def test_malformed_index_is_named(tmp_path):
    write_checkpoint(tmp_path, CONFIG, hf_tensors(CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is malformed"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_fifo_weights_file_is_refused_without_blocking(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="is not a regular file"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_tensor_in_two_shards_is_refused(tmp_path):
    tensors = hf_tensors(CONFIG)
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]} | {"model.norm.weight": tensors["model.norm.weight"]}
    second = {n: tensors[n] for n in names[len(names) // 2 :]}
    assert "model.norm.weight" in second
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for shard, part in zip(shards, (first, second)):
        save_file(part, str(tmp_path / shard))
    weight_map = {n: shards[0] for n in first} | {n: shards[1] for n in second}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match=rf"^tensor 'model.norm.weight' appears in two shards: {shards[0]} and "
                                              rf"{shards[1]}$"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_config_far_larger_than_its_weights_is_refused_before_loading(tmp_path):
    """64 layers in config.json, 2 in the weights: refused from the files' sizes, not by listing
    hundreds of missing tensors (nor by allocating 64 layers)."""
    path = write_checkpoint(tmp_path, CONFIG, hf_tensors(CONFIG))
    (path / "config.json").write_text(json.dumps(CONFIG | {"num_hidden_layers": 64}))
    with pytest.raises(CheckpointError, match=r"^config.json's sizes \(num_hidden_layers 64, hidden_size 32, "
                                              r"intermediate_size 48, vocab_size 64\) call for [\d,]+ parameters, at "
                                              r"least [\d.]+ MiB of weights, but the weights files hold [\d.]+ KiB$"):
        QwenForCausalLM.from_pretrained(path)
    (path / "config.json").write_text(json.dumps(CONFIG | {"num_hidden_layers": 3}))  # fits the files' size
    with pytest.raises(CheckpointError, match=r"^checkpoint is missing tensor\(s\): model\.layers\.2\.input_layernorm"
                                              r"\.weight, (\S+, ){8}\S+ and 2 more$"):
        QwenForCausalLM.from_pretrained(path)


def test_string_false_for_a_flag_is_refused(tmp_path):
    """"false" is not read as true: an untied checkpoint's lm_head is never dropped silently."""
    path = write_checkpoint(tmp_path, CONFIG | {"tie_word_embeddings": "false"}, hf_tensors(CONFIG))
    with pytest.raises(ConfigError, match=r"^config.json: tie_word_embeddings must be true or false \(a JSON "
                                          r"boolean\), got 'false'$"):
        QwenForCausalLM.from_pretrained(path)


# ------------------------------------------------------------------ side files: regular files, bounded

HOSTILE = {
    "fifo": (os.mkfifo, "is not a regular file (a FIFO)"),
    "dev-zero": (lambda p: os.symlink("/dev/zero", p),
                 "(a link to /dev/zero) is not a regular file (a character device)"),
}
"""Files that would block a reader (a FIFO) or feed it without end (/dev/zero), and how each is refused."""
READERS = {
    "config.json": {"resolve", "checkpoint", "weights"},
    "tokenizer.json": {"resolve", "checkpoint"},
    "tokenizer_config.json": {"checkpoint"},
    "generation_config.json": {"checkpoint"},
    "model.safetensors": {"checkpoint", "weights"},
    INDEX_FILE: {"checkpoint", "weights"},
    MARKER: set(),
}
"""Which of PROBE's loaders read each file of a checkpoint."""
PROBE = """
import contextlib, io, json, sys
from modeling import QwenForCausalLM
from modeling.api.checkpoint import Checkpoint
from modeling.cli.generate import main
from modeling.model.hub import resolve_model
from modeling.model.random_checkpoint import is_complete

out = {}
for d in sys.argv[1:]:
    out[d] = {"complete": is_complete(d)}
    for name, load in (("resolve", resolve_model), ("checkpoint", Checkpoint.load),
                       ("weights", QwenForCausalLM.from_pretrained)):
        try:
            load(d)
            out[d][name] = "ok"
        except ValueError as e:
            out[d][name] = str(e)
    if out[d]["checkpoint"] != "ok":
        with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()) as text:
            code = main(["--model", d, "--prompt", "hi", "--device", "cpu"])
        out[d]["command line"] = [code, text.getvalue(), err.getvalue()]
print(json.dumps(out))
"""
"""Loads each checkpoint directory named on its command line every way there is (the command line
too, where Checkpoint.load fails); prints what each way said."""


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory) -> Path:
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def hostile_copy(src: Path, dst: Path, file: str, kind: str) -> Path:
    """A copy of the checkpoint ``src`` with ``file`` replaced by the HOSTILE ``kind`` of file."""
    shutil.copytree(src, dst)
    if (dst / file).exists():
        (dst / file).unlink()
    HOSTILE[kind][0](dst / file)
    return dst


@needs_fifo
def test_checkpoint_files_that_are_not_regular_files_are_refused_without_blocking(tmp_path, random_ckpt):
    """Each file of a checkpoint as a FIFO and as a link to /dev/zero, loaded every way (the Hub /
    directory check, Checkpoint.load, QwenForCausalLM.from_pretrained): whatever reads the file
    refuses it in one line naming it, the others are not affected. In a separate process with a
    timeout, so that a regression fails rather than hangs."""
    cases = {str(hostile_copy(random_ckpt, tmp_path / f"{kind}-{file}", file, kind)): (file, kind)
             for kind in HOSTILE for file in READERS}
    p = isolated("-c", PROBE, *cases)
    assert p.returncode == 0, p.stderr
    for d, results in json.loads(p.stdout).items():
        file, kind = cases[d]
        assert results.pop("complete") == (file == INDEX_FILE), (file, kind)  # every other file is the builder's
        if READERS[file]:  # python -m modeling.generate --model d: exit status 2, one line
            assert results.pop("command line") == [2, "", f"error: --model {d!r}: {file} {HOSTILE[kind][1]}\n"]
        for loader, said in results.items():
            if loader in READERS[file]:
                assert f"{file} {HOSTILE[kind][1]}" in said and "\n" not in said, (file, kind, loader, said)
            else:
                assert said == "ok", (file, kind, loader, said)


@needs_fifo
def test_command_line_refuses_a_fifo_side_file(tmp_path, random_ckpt):
    """The case as it was seen: ``python -m modeling.generate --model DIR`` with a FIFO as
    generation_config.json read it forever; now exit status 2, one line naming the file."""
    path = hostile_copy(random_ckpt, tmp_path / "ckpt", "generation_config.json", "fifo")
    p = isolated("-m", "modeling.generate", "--model", path, "--prompt", "hi", "--device", "cpu")
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == f"error: --model {str(path)!r}: generation_config.json is not a regular file (a FIFO)\n"


def test_side_file_larger_than_its_limit_is_refused_unread(tmp_path):
    """A 1 GiB config.json (sparse: nothing is written) is refused from its size."""
    with open(tmp_path / "config.json", "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(ConfigError, match=r"^config.json is 1 GiB, larger than the 64 MiB this package reads of "
                                          r"such a file$"):
        QwenConfig.from_pretrained(tmp_path)
    assert SIDE_FILE_LIMIT == 64 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_file_that_reports_no_size_is_read_within_the_limit(tmp_path):
    """/proc files are regular files of size 0 that hold text: the read itself stops at the limit."""
    os.symlink("/proc/self/status", tmp_path / "config.json")
    assert os.stat(tmp_path / "config.json").st_size == 0
    with pytest.raises(ValueError, match="^config.json is larger than the 16 bytes this package reads of such a file$"):
        read_file(tmp_path / "config.json", 16)
    assert read_file(tmp_path / "config.json", 1 << 20).startswith(b"Name:")


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), r"^config.json is not a regular file \(a directory\)$"),
    (lambda p: p.symlink_to(p.parent / "nowhere"), r"^config.json is a link to .*nowhere, which does not exist$"),
    (lambda p: p.write_text("[" * 100_000), r"^unreadable config.json \(RecursionError: "),
    (lambda p: p.write_bytes(b'{"a": "caf\xe9"}'), r"^unreadable config.json \(UnicodeDecodeError: "),
])
def test_unreadable_config_is_named(tmp_path, make, message):
    make(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------- dtypes and values


@pytest.mark.parametrize("dtype, code", [(torch.int8, "I8"), (torch.bool, "BOOL"), (torch.int64, "I64")])
def test_non_float_tensor_is_refused_before_loading(tmp_path, dtype, code):
    name = "model.layers.1.mlp.down_proj.weight"
    tensors = hf_tensors(CONFIG)
    tensors[name] = tensors[name].to(dtype)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype {code}: weights must be floating point"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_float64_and_half_tensors_are_converted(tmp_path):
    """F64 is converted down to the target dtype like F32 (no warning); checkpoints may mix dtypes."""
    tensors = hf_tensors(CONFIG)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].double()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16()
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors), dtype=torch.float32)
    assert torch.equal(model.embed_tokens, tensors["model.embed_tokens.weight"].float())
    assert torch.equal(model.norm, tensors["model.norm.weight"].float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_named(tmp_path, bad):
    name = "model.layers.0.self_attn.k_proj.bias"
    tensors = hf_tensors(CONFIG)
    tensors[name][3] = bad
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has non-finite values \(NaN or inf\)"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors), dtype=torch.float32)


def test_weight_that_overflows_the_target_dtype_is_named(tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors = hf_tensors(CONFIG)
    tensors[name][0, 0] = 1e6  # fine in fp32, inf in fp16
    path = write_checkpoint(tmp_path, CONFIG, tensors)
    assert QwenForCausalLM.from_pretrained(path, dtype=torch.float32).layers[1].o_weight[0, 0] == 1e6
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' overflows float16 \(max \|value\| 1e\+06\)"):
        QwenForCausalLM.from_pretrained(path, dtype=torch.float16)


# ------------------------------------------------------------------------------------- Qwen3.5

QWEN3_5 = dict(CONFIG, model_type="qwen3_5_text", num_hidden_layers=2, full_attention_interval=2,
               linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


def test_qwen3_5_plan_and_skipped_tensors(tmp_path):
    tensors = hf_tensors(QWEN3_5)
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (64, 1, 4)  # C = 2*16 + 2*16
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (2 * 4 * 16, 32)  # query and gate
    extra = {"mtp.fc.weight": torch.randn(4, 4), "model.visual.blocks.0.attn.qkv.weight": torch.randn(4, 4)}
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, QWEN3_5, tensors | extra),
                                            dtype=torch.float32)
    la = "model.layers.0.linear_attn."
    fused = torch.cat([tensors[la + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
    assert torch.equal(model.layers[0].in_proj_weight, fused)
    assert torch.equal(model.layers[0].A_log, tensors[la + "A_log"])


@pytest.mark.parametrize("name", ["model.layers.0.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.dt_bias",
                                  "model.layers.1.self_attn.q_norm.weight"])
def test_qwen3_5_missing_tensor(tmp_path, name):
    tensors = hf_tensors(QWEN3_5)
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, QWEN3_5, tensors))


def test_qwen3_5_wrapper_names(tmp_path):
    """The wrapper's text weights live under model.language_model.; text-only names are unexpected."""
    wrapper = {"model_type": "qwen3_5", "text_config": QWEN3_5 | {"model_type": "qwen3_5_text"}}
    tensors = hf_tensors(wrapper)
    assert "model.language_model.layers.0.linear_attn.A_log" in tensors
    QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, wrapper, tensors), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.language_model\.embed_tokens\.weight"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, wrapper, hf_tensors(QWEN3_5)))


@pytest.mark.parametrize("damage", ["truncated", "header length", "offsets"])
def test_corrupt_weights_file_is_named(tmp_path, damage):
    """A truncated file, a header that claims a huge size, offsets past the data: a CheckpointError
    that names the file, not a raw safetensors error."""
    write_checkpoint(tmp_path, CONFIG, hf_tensors(CONFIG))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "header length":
        data = (10**12).to_bytes(8, "little") + data[8:]
    else:
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [0, 10**9]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        data = len(raw).to_bytes(8, "little") + raw + data[8 + n :]
    weights.write_bytes(data)
    with pytest.raises(CheckpointError, match="model.safetensors' is not a valid safetensors file"):
        QwenForCausalLM.from_pretrained(tmp_path)
