"""How launchers start kernels: `@kernel` in place of `@triton.jit` on every kernel a launcher
launches. `k[grid](*args, **meta)` reads like a Triton launch and takes one of three paths:

- **Eager on CUDA, a specialization seen before**: the compiled kernel is found in a dict keyed
  by what Triton specializes a kernel on, and started through its C launcher directly. Triton's
  own `JITFunction.run` redoes its binding, cache-key string, option parsing, global-value checks
  and driver queries on every call; this path costs a dict lookup and the launch (the host cost
  of an op call is what eager prefill and training pay per kernel).
- **Traced** (inside `traced()`, which an op's torch.compile rule enters, see
  `qwen_ops.registry`): through `torch.library.wrap_triton`, so Inductor sees the kernel itself
  and launches it from its generated code. Programmatic Dependent Launch is off there.
- **Otherwise**: Triton's `JITFunction.run`. That is the first launch of a specialization (its
  compiled kernel is then cached here), every launch under the interpreter (nothing is cached
  there), every launch while a Triton launch hook is set (a profiler's) or Triton's debug
  mode is on, checked per launch, and every launch where the C launcher, a private Triton API,
  is off (`private_apis.TRITON`: an untested Triton version or QWEN_PRIVATE_APIS=0).

The key, per argument (exactly as fine as Triton's specialization, or finer, so a cached kernel
is never launched with arguments it was not compiled for): a tensor's dtype and whether its
address is 16-byte aligned; an int's `== 1`, `% 16 == 0` and range (i32, i64 or u64); a float's
type; a TMA tensor descriptor's dtype, block shape and padding (and its shape and strides as ints);
any other value (constexprs, bools, None) itself. Device and launch options join the key.
`_arg_key` states the rule; each kernel computes it with a function generated for its
parameters (`spec_function`), the tensor and 32-bit int cases inlined.
Inside `recording(list)`, each launch also appends what it started (the compiled-kernel entry, the
grid, the arguments), or None where it went through Triton: `qwen_ops.plans` builds its replays
from that. Runtime (non-constexpr) parameters must be passed positionally, constexprs by keyword or
position; the grid is a tuple. Triton settings other than hooks and debug (instrumentation,
pre-run hooks) are read when a specialization is first compiled, not per launch.
"""
import os
import threading
from contextlib import contextmanager

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import private_apis

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when Triton runs kernels through its CPU interpreter (read once at import, as Triton does)."""


class _State(threading.local):
    traced = False
    recording = None  # a list while `recording()` is active: what cached launches happened, in order


_state = _State()


def is_traced() -> bool:
    """Inside `traced()`: launchers see torch.compile's storage-less tensors (no data_ptr)."""
    return _state.traced


@contextmanager
def traced():
    """Launches inside go through `wrap_triton` (torch.compile sees them) instead of starting."""
    before = _state.traced
    _state.traced = True
    try:
        yield
    finally:
        _state.traced = before


@contextmanager
def recording(launches: list):
    """Inside, every cached launch appends (compiled kernel entry, grid, positional args) to
    `launches`, and a launch through Triton (a first compile, a hook) appends None: what
    `qwen_ops.plans` replays."""
    before = _state.recording
    _state.recording = launches
    try:
        yield
    finally:
        _state.recording = before


_runtime = getattr(getattr(triton, "knobs", None), "runtime", None)  # Triton >= 3.4


def _through_triton() -> bool:
    """Launch through `JITFunction.run`: a launch hook is set (Triton keeps hooks in chains, empty
    by default), Triton's debug mode is on, this Triton has no `knobs` to tell, or the private C
    launcher is off."""
    rt = _runtime
    if rt is None or not private_apis.TRITON:
        return True
    return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)
                or getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook) or rt.debug)


def _arg_key(a):
    cls = a.__class__
    if cls is int:  # most arguments: sizes and strides; Triton types them i32, i64 or u64
        width = 0 if -0x80000000 <= a <= 0x7FFFFFFF else 1 if a < 0x8000000000000000 else 2
        return a == 1, a & 15 == 0, width
    if cls is float:
        return float
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if cls is TensorDescriptor:  # its tensor map is built per launch from the object
        return (cls, a.base.dtype, tuple(a.block_shape), a.padding, getattr(a, "round_f32_to_tf32", False),
                tuple(map(_arg_key, a.shape)), tuple(map(_arg_key, a.strides)))
    return a


_TENSORS = (torch.Tensor, torch.nn.Parameter)


def spec_function(n: int, constexpr_at=frozenset()):
    """`spec(a0, ..., a{n-1})`: the tuple of `_arg_key(a)` for every runtime argument and of the
    value of every constexpr (positions in constexpr_at), with `_arg_key`'s two common cases
    inlined (a plain tensor or parameter; an int in i32 range) and the rest passed to it:
    generated code, since the key is the largest part of a cached launch's Python."""
    items = []
    for i in range(n):
        a = f"a{i}"
        items.append(a if i in constexpr_at else
                     f"(({a}.dtype, {a}.data_ptr() & 15 == 0) if {a}.__class__ in _TENSORS else "
                     f"({a} == 1, {a} & 15 == 0, 0) if {a}.__class__ is int and -0x80000000 <= {a} <= 0x7FFFFFFF "
                     f"else _arg_key({a}))")
    names = ", ".join(f"a{i}" for i in range(n))
    namespace = {"_TENSORS": _TENSORS, "_arg_key": _arg_key}
    exec(f"def spec({names}):\n    return ({''.join(item + ', ' for item in items)})\n", namespace)
    return namespace["spec"]


class Kernel:
    """A @triton.jit kernel with the launch paths above; `.fn` is the JITFunction."""

    def __init__(self, fn):
        self.fn = triton.jit(fn)
        self.compiled: dict = {}
        params = [] if INTERPRET else self.fn.params  # the interpreter's function has no params
        self.names = [p.name for p in params]
        self.runtime_names = {p.name for p in params if not p.is_constexpr}
        constexpr_at = [i for i, p in enumerate(params) if p.is_constexpr]
        self.constexpr_at = frozenset(constexpr_at)
        self.specs: dict = {}  # number of positional arguments -> their spec function

    def __getitem__(self, grid):
        """The launch of grid (a tuple of 1-3 ints); the call returns the compiled kernel (None when traced)."""
        if not isinstance(grid, tuple):
            raise TypeError(f"{self.fn.__name__}: the grid must be a tuple of ints, got {type(grid).__name__}")
        return lambda *args, **meta: self.launch(grid, args, meta)

    def _spec(self, n: int):
        """This kernel's `spec_function` of n positional arguments, made on first use."""
        fn = self.specs.get(n)
        if fn is None:
            fn = self.specs[n] = spec_function(n, self.constexpr_at)
        return fn

    def _key(self, args, meta):
        """The launch key (see the module doc): device, positional arguments' spec, launch options."""
        spec = (self.specs.get(len(args)) or self._spec(len(args)))(*args)
        return torch._C._cuda_getDevice(), spec, tuple(meta.items())

    def launch(self, grid, args, meta):
        if _state.traced:
            return self._launch_traced(grid, args, meta)
        if INTERPRET:
            return self.fn[grid](*args, **meta)
        spec = (self.specs.get(len(args)) or self._spec(len(args)))(*args)  # `_key`, inlined
        key = (torch._C._cuda_getDevice(), spec, tuple(meta.items()))
        hit = self.compiled.get(key)
        if hit is None or _through_triton():
            if _state.recording is not None:
                _state.recording.append(None)
            return self._launch_through_triton(key, grid, args, meta)
        run, function, metadata, constexprs, compiled = hit
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(key[0]),
            function, metadata, None, None, None, *args, *constexprs)
        if _state.recording is not None:
            _state.recording.append((hit, grid, args))
        return compiled

    def _launch_through_triton(self, key, grid, args, meta):
        by_keyword = self.runtime_names.intersection(meta)
        if by_keyword:
            raise TypeError(f"{self.fn.__name__}: pass runtime arguments {sorted(by_keyword)} positionally")
        compiled = self.fn.run(*args, grid=grid, warmup=False, **meta)
        tail = self.names[len(args):]
        launcher = None if compiled is None else private_apis.compiled_launcher(compiled)
        if launcher is not None and not _through_triton() and all(name in meta for name in tail):
            # The trailing constexprs' values are part of the key (meta), so they are stored with it.
            constexprs = tuple(meta[name] for name in tail)
            self.compiled[key] = (*launcher, constexprs, compiled)
        return compiled

    def _launch_traced(self, grid, args, meta):
        meta = {k: v for k, v in meta.items() if k != "launch_pdl"}
        if "USE_PDL" in meta:
            meta["USE_PDL"] = False
        torch.library.wrap_triton(self.fn)[grid](*args, **meta)


def kernel(fn) -> Kernel:
    """`@kernel` on a kernel function: `triton.jit` plus the launch paths of this module."""
    return Kernel(fn)
