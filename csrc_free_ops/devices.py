"""What the launchers know of a device: its properties, its name, the grid size they aim for, and
its tuning tables.

Tuning tables live in one JSON file per GPU, csrc_free_ops/tuning/<device name>.json (the CUDA
device name with spaces as underscores: NVIDIA_H200.json), each table under the dtype it was
measured in:

    {"device": "NVIDIA H200", "<table>": {"bfloat16": {"<key>": <config>, ...}}, ...}

| table | key | config | written by |
|---|---|---|---|
| linear_decode | N,K | linear.DecodeConfig | python -m bench.ops --sweep-splitk |
| linear_prefill | M class,N,K | linear.PrefillConfig | python -m bench.ops --sweep-prefill |
| fused_decode | op,N,K | fused_decode.GemvConfig | python -m bench.fused_decode --sweep |
| moe | E,N,K | {largest M served: moe.MoeConfig} | python -m bench.moe --sweep |
| attention_forward | head block | attention.Tiles | python -m bench.ops --sweep-attn-fwd |
| fp8_prefill | N,K | fp8.PrefillTiles | python -m bench.fp8 --sweep |

A sweep merges its winners into the file of the GPU it runs on (`record`). A launcher asks
`tuned(table, device, dtype, key)`, which answers None for the CPU, a GPU without a file, or a
dtype or shape its table lacks; the launcher then takes its own rule, derived from the device it
runs on (`target_programs`: two programs per SM; `shared_memory_per_block`), never another GPU's
table.
"""
import json
from pathlib import Path

import torch

TUNING_DIR = Path(__file__).with_name("tuning")

INTERPRETER_PROGRAMS = 264
"""`target_programs` off CUDA (the interpreter): a 132-SM GPU's, so the CPU tests take the K splits
and grid shapes a GPU takes."""

_cuda_properties: dict = {}


def cuda_properties(device: torch.device):
    """`torch.cuda.get_device_properties` of a CUDA device (the current one for "cuda"), cached:
    launchers ask on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_properties:
        _cuda_properties[index] = torch.cuda.get_device_properties(index)
    return _cuda_properties[index]


def assume(properties) -> torch.device:
    """cuda:0 taken to be a GPU of these ``properties`` (its ``name``, ``multi_processor_count``,
    ...) for the launch decisions of a process that compiles for a GPU it does not have
    (bench.decode_asm); returns that device."""
    _cuda_properties[0] = properties
    _tables.pop(0, None)
    return torch.device("cuda", 0)


def shared_memory_per_block(device: torch.device) -> "int | None":
    """The shared memory one block may use on a CUDA device, in bytes: the opt-in maximum (227 KB
    on Hopper), else the default per-block limit (ROCm builds lack the opt-in field), else None."""
    props = cuda_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)


def device_name(device: torch.device) -> str:
    """The tables' name for a device: the CUDA device's name with spaces as underscores, or "cpu"."""
    return cuda_properties(device).name.replace(" ", "_") if device.type == "cuda" else "cpu"


def target_programs(device: torch.device) -> int:
    """Programs a launcher's grid aims for: two per SM of a CUDA device (about two waves), else
    INTERPRETER_PROGRAMS."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return 2 * cuda_properties(device).multi_processor_count


def _parse_key(text: str) -> tuple:
    return tuple(int(part) if part.lstrip("-").isdigit() else part for part in text.split(","))


def _load(name: str) -> dict:
    """{table: {dtype: {key tuple: config}}} of the device file `name`.json ({} without one); a moe
    config's inner keys (M buckets) become ints."""
    path = TUNING_DIR / f"{name}.json"
    if not path.exists():
        return {}
    tables = {}
    for table, by_dtype in json.loads(path.read_text()).items():
        if table == "device":
            continue
        tables[table] = {getattr(torch, dtype): {
            _parse_key(key): ({int(m): c for m, c in config.items()} if isinstance(config, dict) else config)
            for key, config in entries.items()} for dtype, entries in by_dtype.items()}
    return tables


_tables: dict = {}  # device index -> _load of its file


def tuned(table: str, device: torch.device, dtype: torch.dtype, key: tuple):
    """The stored config of `key` in `table` for this device and dtype (a list of ints, or for moe
    {largest M served: list}), or None (module doc)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    tables = _tables.get(index)
    if tables is None:
        tables = _tables[index] = _load(device_name(device))
    return tables.get(table, {}).get(dtype, {}).get(key)


def _dumps(data: dict) -> str:
    """The device file's text: one line a config, keys in order."""
    lines = ["{", f' "device": {json.dumps(data["device"])}']
    for table in sorted(k for k in data if k != "device"):
        lines[-1] += ","
        lines.append(f' {json.dumps(table)}: {{')
        for i, (dtype, rows) in enumerate(sorted(data[table].items())):
            lines.append(f'  {json.dumps(dtype)}: {{')
            keys = sorted(rows, key=_parse_key)
            lines += [f'   {json.dumps(key)}: {json.dumps(rows[key])}' + ("," if j < len(keys) - 1 else "")
                      for j, key in enumerate(keys)]
            lines.append("  }" + ("," if i < len(data[table]) - 1 else ""))
        lines.append(" }")
    return "\n".join(lines + ["}", ""])


def record(table: str, gpu: str, dtype: torch.dtype, entries: dict) -> Path:
    """Merge `entries` ({key tuple: config}) into `table` of the file of the GPU named `gpu` (its
    CUDA name) under `dtype`, write it, and make `tuned` read the new file. Returns its path."""
    path = TUNING_DIR / f"{gpu.replace(' ', '_')}.json"
    data = json.loads(path.read_text()) if path.exists() else {"device": gpu}
    rows = data.setdefault(table, {}).setdefault(str(dtype).removeprefix("torch."), {})
    for key, config in entries.items():
        rows[",".join(map(str, key))] = ({str(m): list(c) for m, c in config.items()} if isinstance(config, dict)
                                         else list(config))
    TUNING_DIR.mkdir(exist_ok=True)
    path.write_text(_dumps(data))
    _tables.clear()
    return path
