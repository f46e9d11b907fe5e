"""Launch plans: an op call's Triton launches, replayed for later calls with the same signature.

Off the graph, most of an op call's host time is Python that recomputes, on every call, what only
depends on the inputs' metadata: the checks, the launcher's shapes, strides and configs, each
kernel's launch key. A plan keeps the outcome. A call with a new signature (`key_function`) runs
as usual while it is recorded (`record`); once a recording holds only cached launches (from the
second call on: the first compiles), later calls with that signature skip the checks and the
launcher: they allocate the outputs and scratch and start the recorded kernels with the new
tensors in place of the old (`_replay_function`).

The signature: the current device, whether PDL is off, and per argument its value, or for a
tensor its shape, strides, dtype, device and address modulo 16 (the alignment Triton
specializes on). Every check and launcher decision is a function of these (they read metadata
only), so a signature that passed the checks once passes them again, and every int argument a
launcher computes is the same again.

A recording becomes a plan only if it can be replayed exactly; otherwise the signature keeps the
usual path:
- every aten op the launcher ran was an allocation (`empty*`) or a view: a copy, a fill or any
  other computation would be skipped by a replay;
- every tensor a kernel received is an input, an allocation of the call, or a view of one
  starting at the same address (found by address; two inputs at one address are ambiguous);
- every other kernel argument is an int, float, bool or None (no TMA descriptors: they hold
  addresses);
- every output is one of the call's allocations, not a view of one;
- every launch was a cached one (a first compile goes through Triton: the next call records).

Launchers read their device's tuning tables (`csrc_free_ops.devices.tuned`) when a signature is
recorded: a table changed afterwards reaches new signatures only, until the op's plans are cleared
(`registry.plan_tables[op].clear()`).

Not used under a Triton launch hook or debug mode (a profiler must see each launch), under the
interpreter, when the inputs are not on the current device, or while `enabled` is False
(QWEN_PLANS=0 in the environment sets it so at import).
"""
import os
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csrc_free_ops import common
from csrc_free_ops.launch import _TENSORS, recording

aten = torch.ops.aten
ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
               aten.new_empty_strided.default}
enabled = os.environ.get("QWEN_PLANS", "1") != "0"
"""Whether op calls record and replay plans (read per call)."""
MAX_PLANS = 512
"""Signatures kept per op; the table starts over when full (eager prefill sees a length per prompt)."""


def key_function(schema) -> Optional[Callable]:
    """`key(*args)` for an op's schema: the signature above, as a tuple; None if an argument type
    is not one the signature covers (lists, symbolic sizes), or on a torch built without CUDA."""
    if not hasattr(torch._C, "_cuda_getDevice"):
        return None
    items = ["_device()", "_common._PDL_OFF"]
    for i, a in enumerate(schema.arguments):
        kind = str(a.type)
        tensor = f"(a{i}.shape, a{i}.stride(), a{i}.dtype, a{i}.data_ptr() & 15, a{i}.get_device())"
        if kind == "Tensor":
            items.append(tensor)
        elif kind == "Optional[Tensor]":
            items.append(f"(None if a{i} is None else {tensor})")
        elif kind in ("float", "int", "bool", "Optional[float]", "Optional[int]", "Optional[bool]"):
            items.append(f"a{i}")
        else:
            return None
    names = ", ".join(f"a{i}" for i in range(len(schema.arguments)))
    namespace = {"_device": torch._C._cuda_getDevice, "_common": common}
    exec(f"def key({names}):\n    return ({', '.join(items)},)\n", namespace)
    return namespace["key"]


class _AtenLog(TorchDispatchMode):
    """Keeps the allocations a launcher makes and notes any aten op that is neither one nor a view."""

    def __init__(self):
        super().__init__()
        self.allocations: list = []
        self.other_ops = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ALLOCATIONS:
            self.allocations.append(out)
        elif not func.is_view:
            self.other_ops = True
        return out


class PlanTable(dict):
    """signature -> replay function, or False where the call cannot be replayed exactly."""

    def __init__(self):
        super().__init__()
        self.attempts: dict = {}  # signature -> recordings cut short by a launch through Triton

    def record(self, signature, kernel: Callable, args: tuple):
        """kernel(*args), recorded into this table. A recording with a launch through Triton (a first
        compile) is tried again on the next call, up to three times, then given up (a kernel Triton
        never lets launch.py cache would otherwise make every call pay for a recording)."""
        out, replay = record(kernel, args)
        if replay is None:
            tries = self.attempts.get(signature, 0) + 1
            self.attempts[signature] = tries
            if tries < 3:
                return out
            replay = False
        if len(self) >= MAX_PLANS:
            self.clear()
        self[signature] = replay
        return out

    def clear(self):
        super().clear()
        self.attempts.clear()


def record(kernel: Callable, args: tuple):
    """Run kernel(*args) (a launcher) while recording; returns (its output, the replay function),
    with False in place of the function where the call cannot be replayed exactly, and None where
    a launch went through Triton (a first compile: record again next time)."""
    launches: list = []
    log = _AtenLog()
    with recording(launches), log:
        out = kernel(*args)
    if None in launches:
        return out, None
    if log.other_ops:
        return out, False
    return out, _replay_function(args, launches, log.allocations, out) or False


def _replay_function(args, launches, allocations, out) -> Optional[Callable]:
    """`replay(*args)`: allocate what the kernels and the outputs need, start the recorded launches
    with the new addresses, return the outputs; None if the recording breaks a rule of the module doc."""
    inputs: dict = {}  # address -> argument index; None where two inputs share it
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            inputs[a.data_ptr()] = None if a.data_ptr() in inputs else i
    allocated = {t.data_ptr(): j for j, t in enumerate(allocations)}
    if len(allocated) < len(allocations) or 0 in allocated:  # empty allocations have no address to tell apart
        return None
    used: dict = {}  # allocation index -> its name in the generated code
    namespace = {"_stream": torch._C._cuda_getCurrentRawStream, "_empty": torch.empty_strided}

    def name_of(t) -> Optional[str]:
        p = t.data_ptr()
        if p in inputs:
            return None if inputs[p] is None else f"a{inputs[p]}"
        j = allocated.get(p)
        if j is None:
            return None
        used.setdefault(j, f"b{j}")
        return used[j]

    calls = []
    for i, (hit, grid, kernel_args) in enumerate(launches):
        run, function, metadata, constexprs, _ = hit
        namespace.update({f"run{i}": run, f"fn{i}": function, f"md{i}": metadata})
        names = []
        for j, a in enumerate((*kernel_args, *constexprs)):
            if a.__class__ in _TENSORS:
                name = name_of(a)
                if name is None:  # not an input or an allocation of this call, or ambiguous
                    return None
            elif a is None or a.__class__ in (int, float, bool):
                name = f"c{i}_{j}"
                namespace[name] = a
            else:  # a TMA descriptor (it holds an address) or another object
                return None
            names.append(name)
        g = (*grid, 1, 1)[:3]
        calls.append(f"    run{i}({g[0]}, {g[1]}, {g[2]}, s, fn{i}, md{i}, None, None, None, {', '.join(names)})")
    results = []
    for t in out if isinstance(out, tuple) else (out,):
        j = None if t is None else allocated.get(t.data_ptr())
        if t is not None and (j is None or t.shape != allocations[j].shape or t.stride() != allocations[j].stride()):
            return None  # an input, or a view of an allocation
        results.append("None" if t is None else used.setdefault(j, f"b{j}"))
    lines = [f"def replay({', '.join(f'a{i}' for i in range(len(args)))}):",
             f"    s = _stream({torch._C._cuda_getDevice()})"]
    for j, name in sorted(used.items()):
        t = allocations[j]
        namespace.update({f"{name}_shape": tuple(t.shape), f"{name}_stride": t.stride(), f"{name}_dtype": t.dtype,
                          f"{name}_device": t.device})
        lines.append(f"    {name} = _empty({name}_shape, {name}_stride, dtype={name}_dtype, device={name}_device)")
    lines += calls
    lines.append(f"    return {'(' + ', '.join(results) + ',)' if isinstance(out, tuple) else results[0]}")
    exec("\n".join(lines) + "\n", namespace)
    return namespace["replay"]
