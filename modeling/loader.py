"""Load a Hugging Face Qwen checkpoint (safetensors) into the fused layout of ``modeling.model``.

The checkpoint is ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
Tensors are read one at a time with ``safe_open`` and copied straight into their target
tensor on the target device and dtype, so the host never holds a second full copy.

The plan (``load_plan``) names, for each model tensor, the checkpoint tensors concatenated along
dim 0 to make it. Each layer's part comes from its class in ``modeling.layers.LAYER_TYPES``
(``load_plan(config, "model.layers.{i}.")``); for an attention layer:

- ``layers.{i}.qkv_weight`` [(Hq + 2*Hk) * D, hidden] <- q_proj, k_proj, v_proj weights
- ``layers.{i}.qkv_bias``   [(Hq + 2*Hk) * D]         <- q_proj, k_proj, v_proj biases (qwen2)
- ``layers.{i}.gate_up_weight`` [2 * I, hidden]       <- gate_proj, up_proj weights

and for a Gated DeltaNet layer (Qwen3.5), ``layers.{i}.in_proj_weight`` <- in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a. The text model's names start with ``config.weights_prefix`` (``model.``, or
``model.language_model.`` in the multimodal wrapper); tensors under
``config.skipped_weight_prefixes`` (Qwen3.5's vision tower and MTP head) are ignored.

Each tensor must be floating point (F16, BF16, F32 or F64; F64 is converted down like F32) and,
once converted to the target dtype, finite: a NaN or inf (or a value that overflows the target
dtype) is a ``CheckpointError`` naming the tensor.
"""

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Union

import torch
from safetensors import safe_open

from .config import QwenConfig
from .layers import LAYER_TYPES, LoadPlan, Shape

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match the config: a missing, unexpected or misshapen tensor, a
    tensor that is not floating point, or one with NaN / inf values."""


FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
"""safetensors dtypes a weight may have (F64 is converted down to the target dtype like F32)."""


def load_plan(config: QwenConfig) -> LoadPlan:
    """For each model tensor, the Hugging Face tensors (name, expected shape) it is made of."""
    c, m = config, config.weights_prefix
    plan: LoadPlan = {"embed_tokens": [(m + "embed_tokens.weight", (c.vocab_size, c.hidden_size))]}
    for i, kind in enumerate(c.layer_types):
        for name, sources in LAYER_TYPES[kind].load_plan(c, f"{m}layers.{i}.").items():
            plan[f"layers.{i}.{name}"] = sources
    plan["norm"] = [(m + "norm.weight", (c.hidden_size,))]
    if not c.tie_word_embeddings:
        plan["lm_head"] = [("lm_head.weight", (c.vocab_size, c.hidden_size))]
    return plan


def checkpoint_files(path: Union[str, Path]) -> List[Path]:
    """The safetensors files of a checkpoint directory: one file, or the shards of the index.

    Shard names must be plain file names inside the directory (no absolute paths, no ``..``),
    and every file must be a regular file (a FIFO or a device would block or mislead the reader).
    """
    path = Path(path)
    if (path / INDEX_FILE).exists():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
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
        if not f.exists():
            raise CheckpointError(f"checkpoint file {str(f)!r} not found")
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {str(f)!r} is not a regular file")
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
    plan = load_plan(config)
    expected = {name: shape for sources in plan.values() for name, shape in sources}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    skipped = tuple(config.skipped_weight_prefixes)
    device = torch.device(device)
    with ExitStack() as stack:
        handles = {}
        for f in checkpoint_files(path):
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt", device=str(device)))
            except Exception as e:  # safetensors' own error type differs between its versions
                raise CheckpointError(f"checkpoint file {str(f)!r} is not a valid safetensors file "
                                      f"(truncated or corrupt: {e})") from None
            for name in handle.keys():
                if name in handles:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard")
                if not (skipped and name.startswith(skipped)):
                    handles[name] = handle
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
        raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing)}")
    unexpected = sorted(set(handles) - set(expected) - ignored)
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor(s): {', '.join(unexpected)}")
    for name, shape in expected.items():
        tensor = handles[name].get_slice(name)
        found = tuple(tensor.get_shape())
        if found != shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(found)}, the config expects {list(shape)}")
        if tensor.get_dtype() not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.get_dtype()}: weights must be floating point "
                                  f"({', '.join(FLOAT_DTYPES)})")
