"""Load a Hugging Face Qwen checkpoint (safetensors: ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``) into the fused layout of ``modeling.model.causal_lm``
(``load_state_dict``; ``check_weights_size``; ``CheckpointError``). docs/modeling.md ("Loading",
"FP8", "Tensor parallelism") describes the checks, the fused tensors, the reads and what stays FP8.

The plan (``load_plan``) names, for each model tensor, the checkpoint tensors concatenated along
dim 0 to make it (each layer's part from its class in ``modeling.model.layers.LAYER_TYPES``).
FP8: a linear weight (``linear_targets``) whose quantised sources lead its plan, each but the last
a whole number of 128-row blocks, stays FP8 with its unquantised sources as the tail, and experts
(``expert_targets``) whose every source is quantised and stacks so stay FP8, where
``fp8.keeps_fp8`` says so; any other quantised source is dequantised.
"""

import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open

from . import fp8
from .config import QwenConfig
from .files import format_size, open_file, read_json
from .layers import LAYER_TYPES, LoadPlan, Shape, SplitPlan
from .moe import FUSED_EXPERTS, SparseMoeBlock
from .tensor_parallel import SINGLE, Split, TensorParallel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match the config: a missing, unexpected or misshapen tensor, a
    tensor that is not floating point, or one with NaN / inf values."""


FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
"""safetensors dtypes a weight may have (F64 is converted down to the target dtype like F32)."""
FP8_DTYPE = "F8_E4M3"
"""The safetensors dtype of an FP8 weight (one with a ``weight_scale_inv`` beside it)."""
SCALE_SUFFIX = "_scale_inv"
"""An FP8 weight ``X.weight``'s scales are ``X.weight_scale_inv``."""
MIN_WEIGHT_BYTES = 2
"""Bytes of the narrowest weight dtype (F16, BF16): a checkpoint holds at least this per parameter
(1 in an FP8 checkpoint)."""


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


def split_plan(config: QwenConfig) -> SplitPlan:
    """How the checkpoint tensors split over tensor-parallel ranks: the embedding and lm_head by
    vocabulary rows, each layer's by its kind's ``split_plan``; the others are replicated."""
    c, m = config, config.weights_prefix
    vocab = Split(0, ((c.vocab_size, 1),))
    plan: SplitPlan = {m + "embed_tokens.weight": vocab, "lm_head.weight": vocab}
    for i, kind in enumerate(c.layer_types):
        plan |= LAYER_TYPES[kind].split_plan(c, f"{m}layers.{i}.")
    return plan


def checkpoint_files(path: Union[str, Path]) -> List[Path]:
    """The safetensors files of a checkpoint directory: one file, or the shards of the index (plain
    file names inside the directory), each a regular file (``modeling.model.files.open_file``)."""
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
    least = count * (1 if config.quantization else MIN_WEIGHT_BYTES)
    if least > have:
        c = config
        raise CheckpointError(
            f"config.json's sizes (num_hidden_layers {c.num_hidden_layers}, hidden_size {c.hidden_size}, "
            f"intermediate_size {c.intermediate_size}, vocab_size {c.vocab_size}) call for {count:,} parameters, "
            f"at least {format_size(least)} of weights, but the weights files hold {format_size(have)}")
    return files


def load_state_dict(
    path: Union[str, Path],
    config: QwenConfig,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    quantize: bool = False,
    parallel: TensorParallel = SINGLE,
) -> Dict[str, torch.Tensor]:
    """Read the checkpoint at ``path`` into the model's fused tensors on ``device`` in ``dtype``
    (FP8 weights, their ``*_scale_inv`` and ``*_tail``: see the module doc); with ``parallel``
    (world size > 1) this rank's shards of them, each read as its slices only. Every tensor's name,
    shape and dtype is checked before any is loaded, and every loaded tensor for NaN / inf."""
    parallel.local_config(config)  # a model that does not split is refused before anything is read
    splits = split_plan(config) if parallel.world_size > 1 else {}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    skipped = tuple(config.skipped_weight_prefixes)
    device = torch.device(device)
    keep_fp8 = fp8.keeps_fp8(device, dtype)
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
        scales = {name + SCALE_SUFFIX: _scale_shape(shape) for name, shape in expected.items()
                  if name + SCALE_SUFFIX in handles}
        if scales and not config.quantization:
            raise CheckpointError(f"tensor {next(iter(scales))!r} is an FP8 weight's scales, but config.json has no "
                                  "quantization_config")
        _check(handles, expected, scales, ignored)
        linear = linear_targets(config) if keep_fp8 else set()
        experts = expert_targets(config) if keep_fp8 else set()
        state = {}
        finite = []  # (name, 0-dim bool tensor on the device): read back once, not once per tensor

        def stack(sources) -> torch.Tensor:
            """The sources (this rank's slices of those that split) stacked along dim 0 in ``dtype``."""
            shapes = [_local_shape(shape, splits.get(name), parallel) for name, shape in sources]
            out = torch.empty((sum(shape[0] for shape in shapes), *shapes[0][1:]), dtype=dtype, device=device)
            row = 0
            for (name, _), shape in zip(sources, shapes):
                part = out[row : row + shape[0]]
                if name in splits:
                    _read_split(handles[name], name, splits[name], parallel, part)
                else:
                    part.copy_(_read(handles, name, scales, dtype))
                finite.append((name, torch.isfinite(part).all()))
                row += shape[0]
            return out

        for target, sources in plan.items():
            quantized = sum(1 for name, _ in sources if name + SCALE_SUFFIX in scales)
            if (target in linear and quantized and _leading_blocks(sources, scales)
                    or target in experts and _expert_blocks(sources, scales, config.num_experts)):
                parts = _fp8_blocks(sources[:quantized], handles, device, finite)  # every source, for experts
                if target in experts:
                    parts = [t.view(config.num_experts, -1, t.shape[-1]) for t in parts]
                state[target], state[target + SCALE_SUFFIX] = parts
                if quantized < len(sources):  # the unquantised rows after them
                    state[target + "_tail"] = stack(sources[quantized:])
                continue
            out = state[target] = stack(sources)
            if quantize and (target in linear or target in experts):
                weight = out if target in linear else out.view(config.num_experts, -1, out.shape[-1])
                state[target], state[target + SCALE_SUFFIX] = fp8.quantize(weight)
        if finite:
            ok = torch.stack([f for _, f in finite]).cpu()
            if not ok.all():
                name = finite[int((~ok).nonzero()[0])][0]
                raise CheckpointError(_non_finite(name, _read(handles, name, scales, torch.float32), dtype))
    return state


def linear_targets(config: QwenConfig) -> set:
    """The model tensors that may hold FP8 linear weights (``modeling.model.fp8.linear``): each
    layer's ``linear_weights``, and a sparse MLP's shared expert."""
    layers = {f"layers.{i}.{name}" for i, kind in enumerate(config.layer_types)
              for name in LAYER_TYPES[kind].linear_weights(i in config.moe_layers)}
    return layers | {f"layers.{i}.mlp.{name}" for i in config.moe_layers for name in SparseMoeBlock.LINEAR_WEIGHTS}


def expert_targets(config: QwenConfig) -> set:
    """The model tensors that may hold FP8 experts [E, N, K] (``fused_moe``'s w13 and w2)."""
    return {f"layers.{i}.mlp.{name}" for i in config.moe_layers for name in SparseMoeBlock.EXPERT_WEIGHTS}


def fp8_targets(config: QwenConfig) -> set:
    """Every model tensor that may hold FP8 weights."""
    return linear_targets(config) | expert_targets(config)


def _local_shape(shape: Shape, split: Optional[Split], parallel: TensorParallel) -> Shape:
    """A checkpoint tensor's shape on this rank: ``shape`` with its split dim cut to the rank's
    elements (``shape`` itself if replicated)."""
    if split is None:
        return shape
    size = sum(stop - start for start, stop in parallel.ranges(split))
    return (*shape[: split.dim], size, *shape[split.dim + 1 :])


def _read_split(handle, name: str, split: Split, parallel: TensorParallel, out: torch.Tensor) -> None:
    """Copy this rank's slices of checkpoint tensor ``name`` into ``out`` (its local shape), one
    ``get_slice`` read a section: nothing else of the tensor is read."""
    tensor = handle.get_slice(name)
    lead = (slice(None),) * split.dim
    offset = 0
    for start, stop in parallel.ranges(split):
        out.narrow(split.dim, offset, stop - start).copy_(tensor[(*lead, slice(start, stop))])
        offset += stop - start


def _scale_shape(shape: Shape) -> Shape:
    """The ``weight_scale_inv`` shape of a weight [..., N, K]: [..., cdiv(N, 128), cdiv(K, 128)]."""
    return (*shape[:-2], -(-shape[-2] // fp8.BLOCK), -(-shape[-1] // fp8.BLOCK))


def _leading_blocks(sources, scales: Dict[str, Shape]) -> bool:
    """Whether the quantised sources come first, each but the last a whole number of 128-row blocks
    (so their blocks and scales stack into one FP8 weight)."""
    flags = [name + SCALE_SUFFIX in scales for name, _ in sources]
    n = sum(flags)
    return all(flags[:n]) and all(shape[0] % fp8.BLOCK == 0 for _, shape in sources[: n - 1])


def _expert_blocks(sources, scales: Dict[str, Shape], experts: int) -> bool:
    """Whether every source is quantised and each expert's sources (``len(sources) / experts`` in a
    row, or one fused source of all experts) stack into one block grid (``_leading_blocks``)."""
    group = max(1, len(sources) // experts)
    return (all(name + SCALE_SUFFIX in scales for name, _ in sources)
            and all(_leading_blocks(sources[i : i + group], scales) for i in range(0, len(sources), group)))


def _read(handles: Dict, name: str, scales: Dict[str, Shape], dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint tensor ``name``, dequantised into ``dtype`` if it is an FP8 weight."""
    t = handles[name].get_tensor(name)
    scale = name + SCALE_SUFFIX
    return fp8.dequantize(t, handles[scale].get_tensor(scale), dtype) if scale in scales else t


def _fp8_blocks(sources, handles: Dict, device: torch.device, finite: list) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP8 sources stacked along dim 0 and their scales (fp32) stacked alike: each but the last
    a whole number of 128-row blocks (``_leading_blocks``)."""
    inner = sources[0][1][1:]
    weight = torch.empty((sum(shape[0] for _, shape in sources), *inner), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty((sum(_scale_shape(shape)[0] for _, shape in sources), *_scale_shape(sources[0][1])[1:]),
                        dtype=torch.float32, device=device)
    row = block = 0
    for name, shape in sources:
        weight[row : row + shape[0]].copy_(handles[name].get_tensor(name))
        s = scale[block : block + _scale_shape(shape)[0]]
        s.copy_(handles[name + SCALE_SUFFIX].get_tensor(name + SCALE_SUFFIX))
        # e4m3fn has no inf and one NaN per sign (low seven bits all set): no fp32 copy of the weight
        finite.append((name, ((weight[row : row + shape[0]].view(torch.uint8) & 0x7F) != 0x7F).all()))
        finite.append((name + SCALE_SUFFIX, torch.isfinite(s).all()))
        row, block = row + shape[0], block + _scale_shape(shape)[0]
    return weight, scale


def _non_finite(name: str, source: torch.Tensor, dtype: torch.dtype) -> str:
    if torch.isfinite(source).all():
        return (f"tensor {name!r} overflows {str(dtype).replace('torch.', '')} (max |value| "
                f"{source.abs().max().item():.4g}): load it in a wider dtype")
    return f"tensor {name!r} has non-finite values (NaN or inf)"


def _check(handles: Dict, expected: Dict[str, Shape], scales: Dict[str, Shape], ignored: set) -> None:
    missing = sorted(set(expected) - set(handles))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s): {_names(missing)}")
    unexpected = sorted(set(handles) - set(expected) - set(scales) - ignored)
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor(s): {_names(unexpected)}")
    for name, shape in (expected | scales).items():
        tensor = handles[name].get_slice(name)
        found = tuple(tensor.get_shape())
        if found != shape:
            what = "the weight's blocks of 128 call for" if name in scales else "the config expects"
            raise CheckpointError(f"tensor {name!r} has shape {list(found)}, {what} {list(shape)}")
        if name + SCALE_SUFFIX in scales:  # read as e4m3 blocks times their scales: nothing else is
            if tensor.get_dtype() != FP8_DTYPE:
                raise CheckpointError(f"tensor {name!r} has dtype {tensor.get_dtype()}, but {name + SCALE_SUFFIX} "
                                      f"beside it makes it an FP8 weight: it must be {FP8_DTYPE}")
        elif tensor.get_dtype() not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.get_dtype()}: weights must be floating point "
                                  f"({', '.join(FLOAT_DTYPES)})" + ("" if name in scales else
                                                                   f"; an {FP8_DTYPE} weight needs its "
                                                                   f"{name + SCALE_SUFFIX}"))


def _names(names: Sequence[str], shown: int = 10) -> str:
    """The first ``shown`` names, then how many more: one line even for thousands."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
