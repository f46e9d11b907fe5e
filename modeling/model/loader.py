"""Load a Hugging Face Qwen checkpoint (safetensors) into the fused layout of ``modeling.model.causal_lm``.

The checkpoint is ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
Tensors are read one at a time with ``safe_open`` and copied straight into their target
tensor on the target device and dtype, so the host never holds a second full copy.

The plan (``load_plan``) names, for each model tensor, the checkpoint tensors concatenated along
dim 0 to make it. Each layer's part comes from its class in ``modeling.model.layers.LAYER_TYPES``
(``load_plan(config, "model.layers.{i}.")``); for an attention layer:

- ``layers.{i}.qkv_weight`` [(Hq + 2*Hk) * D, hidden] <- q_proj, k_proj, v_proj weights
- ``layers.{i}.qkv_bias``   [(Hq + 2*Hk) * D]         <- q_proj, k_proj, v_proj biases (qwen2)
- ``layers.{i}.gate_up_weight`` [2 * I, hidden]       <- gate_proj, up_proj weights

and for a Gated DeltaNet layer (Qwen3.5), ``layers.{i}.in_proj_weight`` <- in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a. A mixture-of-experts layer's ``layers.{i}.mlp.*`` (``modeling.model.moe``)
come from the experts one by one (the Hub's layout: ``mlp.experts.{e}.gate_proj.weight`` ...) or
fused (transformers 5's: ``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``): the
loader takes the layout the checkpoint holds (``fused_experts``). The text model's names start
with ``config.weights_prefix`` (``model.``, or ``model.language_model.`` in the multimodal
wrapper); tensors under ``config.skipped_weight_prefixes`` (Qwen3.5's vision tower and MTP head)
are ignored.

Each tensor must be floating point (F16, BF16, F32 or F64; F64 is converted down like F32) and,
once converted to the target dtype, finite: a NaN or inf (or a value that overflows the target
dtype) is a ``CheckpointError`` naming the tensor.

Every file is opened through ``modeling.model.files`` (regular files only: a FIFO or a link to a device
is refused without blocking). Before anything is allocated, the weights files must be large enough
for the config's parameters at 2 bytes each (``check_weights_size``), so a config.json whose sizes
are far off the weights is refused from the files' sizes alone.
"""

import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Sequence, Union

import torch
from safetensors import safe_open

from .config import QwenConfig
from .files import format_size, open_file, read_json
from .layers import LAYER_TYPES, LoadPlan, Shape
from .moe import FUSED_EXPERTS

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match the config: a missing, unexpected or misshapen tensor, a
    tensor that is not floating point, or one with NaN / inf values."""


FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
"""safetensors dtypes a weight may have (F64 is converted down to the target dtype like F32)."""
MIN_WEIGHT_BYTES = 2
"""Bytes of the narrowest weight dtype (F16, BF16): a checkpoint holds at least this per parameter."""


def load_plan(config: QwenConfig, fused_experts: bool = False) -> LoadPlan:
    """For each model tensor, the Hugging Face tensors (name, expected shape) it is made of; the
    experts of a mixture-of-experts layer one by one, or fused (``fused_experts``)."""
    c, m = config, config.weights_prefix
    plan: LoadPlan = {"embed_tokens": [(m + "embed_tokens.weight", (c.vocab_size, c.hidden_size))]}
    for i, kind in enumerate(c.layer_types):
        prefix = f"{m}layers.{i}."
        for name, sources in LAYER_TYPES[kind].load_plan(c, prefix, i in c.moe_layers, fused_experts).items():
            plan[f"layers.{i}.{name}"] = sources
    plan["norm"] = [(m + "norm.weight", (c.hidden_size,))]
    if not c.tie_word_embeddings:
        plan["lm_head"] = [("lm_head.weight", (c.vocab_size, c.hidden_size))]
    return plan


def checkpoint_files(path: Union[str, Path]) -> List[Path]:
    """The safetensors files of a checkpoint directory: one file, or the shards of the index.

    Shard names must be plain file names inside the directory (no absolute paths, no ``..``),
    and every file must be a regular file (``modeling.model.files.open_file``: a FIFO or a device would
    block or mislead the reader).
    """
    path = Path(path)
    index = path / INDEX_FILE
    if os.path.lexists(index):
        try:
            weight_map = read_json(index, CheckpointError)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{INDEX_FILE} is malformed ({type(e).__name__}: {e}); it needs a "
                                  "'weight_map' of tensor name -> shard file name") from None
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise CheckpointError(f"{INDEX_FILE} names shard {name!r}: shards must be file names "
                                      "inside the checkpoint directory")
        files = [path / name for name in names]
    else:
        files = [path / SINGLE_FILE]
    for f in files:
        with open_file(f, CheckpointError):
            pass
    return files


def parameter_count(config: QwenConfig) -> int:
    """Elements of all the checkpoint tensors the config calls for (``load_plan``)."""
    return sum(math.prod(shape) for sources in load_plan(config).values() for _, shape in sources)


def check_weights_size(path: Union[str, Path], config: QwenConfig) -> List[Path]:
    """``checkpoint_files(path)``, once their sizes can hold the config's parameters at
    ``MIN_WEIGHT_BYTES`` each; else a ``CheckpointError`` naming config.json's sizes. Reads no
    tensor and allocates nothing: a config whose sizes are far off its weights is refused here."""
    files = checkpoint_files(path)
    have = sum(f.stat().st_size for f in files)
    count = parameter_count(config)
    if count * MIN_WEIGHT_BYTES > have:
        c = config
        raise CheckpointError(
            f"config.json's sizes (num_hidden_layers {c.num_hidden_layers}, hidden_size {c.hidden_size}, "
            f"intermediate_size {c.intermediate_size}, vocab_size {c.vocab_size}) call for {count:,} parameters, "
            f"at least {format_size(count * MIN_WEIGHT_BYTES)} of weights, but the weights files hold "
            f"{format_size(have)}")
    return files


def load_state_dict(
    path: Union[str, Path],
    config: QwenConfig,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> Dict[str, torch.Tensor]:
    """Read the checkpoint at ``path`` into the model's fused tensors on ``device`` in ``dtype``.

    Every tensor is checked (names, shapes, floating dtypes) before any is loaded, and every
    loaded tensor for NaN / inf (one ``isfinite`` reduction per tensor, read back once at the end).
    A tied-embedding model needs no ``lm_head.weight``; one present anyway is ignored, as are
    tensors under ``config.skipped_weight_prefixes``.
    """
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    skipped = tuple(config.skipped_weight_prefixes)
    device = torch.device(device)
    with ExitStack() as stack:
        handles = {}
        shard_of: Dict[str, str] = {}  # every tensor name -> the file that holds it
        for f in check_weights_size(path, config):
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt", device=str(device)))
            except Exception as e:  # safetensors' own error type differs between its versions
                raise CheckpointError(f"checkpoint file {str(f)!r} is not a valid safetensors file "
                                      f"(truncated or corrupt: {e})") from None
            for name in handle.keys():
                if name in shard_of:
                    raise CheckpointError(f"tensor {name!r} appears in two shards: {shard_of[name]} and {f.name}")
                shard_of[name] = f.name
                if not (skipped and name.startswith(skipped)):
                    handles[name] = handle
        first_sparse = config.moe_layers[:1]
        fused = bool(first_sparse) and f"{config.weights_prefix}layers.{first_sparse[0]}.{FUSED_EXPERTS}" in handles
        plan = load_plan(config, fused)
        expected = {name: shape for sources in plan.values() for name, shape in sources}
        _check(handles, expected, ignored)
        state = {}
        finite = []  # (name, 0-dim bool tensor on the device): read back once, not once per tensor
        for target, sources in plan.items():
            rows = sum(shape[0] for _, shape in sources)
            out = torch.empty((rows, *sources[0][1][1:]), dtype=dtype, device=device)
            row = 0
            for name, shape in sources:
                part = out[row : row + shape[0]]
                part.copy_(handles[name].get_tensor(name))
                finite.append((name, torch.isfinite(part).all()))
                row += shape[0]
            state[target] = out
        if finite:
            ok = torch.stack([f for _, f in finite]).cpu()
            if not ok.all():
                name = finite[int((~ok).nonzero()[0])][0]
                raise CheckpointError(_non_finite(name, handles[name].get_tensor(name), dtype))
    return state


def _non_finite(name: str, source: torch.Tensor, dtype: torch.dtype) -> str:
    if torch.isfinite(source).all():
        return (f"tensor {name!r} overflows {str(dtype).replace('torch.', '')} (max |value| "
                f"{source.abs().max().item():.4g}): load it in a wider dtype")
    return f"tensor {name!r} has non-finite values (NaN or inf)"


def _check(handles: Dict, expected: Dict[str, Shape], ignored: set) -> None:
    missing = sorted(set(expected) - set(handles))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s): {_names(missing)}")
    unexpected = sorted(set(handles) - set(expected) - ignored)
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor(s): {_names(unexpected)}")
    for name, shape in expected.items():
        tensor = handles[name].get_slice(name)
        found = tuple(tensor.get_shape())
        if found != shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(found)}, the config expects {list(shape)}")
        if tensor.get_dtype() not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.get_dtype()}: weights must be floating point "
                                  f"({', '.join(FLOAT_DTYPES)})")


def _names(names: Sequence[str], shown: int = 10) -> str:
    """The first ``shown`` names, then how many more: one line even for thousands."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
