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
    """The checkpoint does not match the config: a missing, unexpected or misshapen tensor."""


def load_plan(config: QwenConfig) -> LoadPlan:
    """For each model tensor, the Hugging Face tensors (name, expected shape) it is made of."""
    c = config
    plan: LoadPlan = {"embed_tokens": [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))]}
    for i, kind in enumerate(c.layer_types):
        for name, sources in LAYER_TYPES[kind].load_plan(c, f"model.layers.{i}.").items():
            plan[f"layers.{i}.{name}"] = sources
    plan["norm"] = [("model.norm.weight", (c.hidden_size,))]
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

    Every tensor is checked (names and shapes) before any is loaded. A tied-embedding model
    needs no ``lm_head.weight``; one present anyway is ignored.
    """
    plan = load_plan(config)
    expected = {name: shape for sources in plan.values() for name, shape in sources}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    device = torch.device(device)
    with ExitStack() as stack:
        handles = {}
        for f in checkpoint_files(path):
            handle = stack.enter_context(safe_open(str(f), framework="pt", device=str(device)))
            for name in handle.keys():
                if name in handles:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard")
                handles[name] = handle
        _check(handles, expected, ignored)
        state = {}
        for target, sources in plan.items():
            rows = sum(shape[0] for _, shape in sources)
            out = torch.empty((rows, *sources[0][1][1:]), dtype=dtype, device=device)
            row = 0
            for name, shape in sources:
                out[row : row + shape[0]].copy_(handles[name].get_tensor(name))
                row += shape[0]
            state[target] = out
    return state


def _check(handles: Dict, expected: Dict[str, Shape], ignored: set) -> None:
    missing = sorted(set(expected) - set(handles))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing)}")
    unexpected = sorted(set(handles) - set(expected) - ignored)
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor(s): {', '.join(unexpected)}")
    for name, shape in expected.items():
        found = tuple(handles[name].get_slice(name).get_shape())
        if found != shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(found)}, the config expects {list(shape)}")
