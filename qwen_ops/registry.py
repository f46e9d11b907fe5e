"""The one way an op enters torch.ops.qwen: `define(reference, kernel, check, fake)`.

Every op is four plain functions with the op's own signature:

- `reference`: the plain-PyTorch math (the test oracle and the CPU path). Its type hints
  are the op's schema (`torch.library.infer_schema`), and its name minus `_reference` is
  the op's name: `rms_norm_reference` defines `torch.ops.qwen.rms_norm`.
- `kernel`: the Triton launcher (csrc_free_ops), called with the same arguments.
- `check`: metadata validation (shapes, dtypes, devices; never tensor values on CUDA),
  run before the kernel or the reference and inside the fake kernel.
- `fake`: allocates outputs of the right shapes and strides without reading data.
- `check_values` (optional): checks that read tensor values; it runs on CPU tensors only
  (free there, a host sync on CUDA, where the kernels clamp instead) and never on fake tensors.

Where an op runs (the real kernel registered for the CPU and CUDA dispatch keys):
CUDA tensors run Triton (on the tensors' device, which need not be the current one); CPU
tensors run Triton under TRITON_INTERPRET=1 (how CI
exercises the kernels) and the reference otherwise; float64 always runs the reference
(the kernels compute in fp32). The op is defined with `torch.library.Library.define` and
plain `impl` registrations: the thinnest Python path the dispatcher offers (`custom_op` and
`triton_op` add several microseconds per call). Kernels start through `csrc_free_ops.launch`.

Under torch.compile (`_trace_into_kernels`), what runs where:
- CUDA tensors of a kernel dtype, static shapes: the op's Triton kernels are traced into the graph,
  as `torch.library.triton_op` would, and Inductor launches them from its own generated code;
- symbolic (dynamic) shapes, CPU tensors (the interpreter cannot be traced), float64, and ops
  defined with `traceable=False` (the fused decode ops): the op stays one opaque node, run as in eager.

Autograd (`register_autograd`): a Python kernel for the Autograd key, as torch.library's, but
leaner. Outside `torch.inference_mode()` every call passes through it; inside, PyTorch skips the
Autograd key altogether. When nothing needs grad and the call's dispatch keys are those of plain
CPU or CUDA tensors (`PLAIN_KEYSETS`), it calls the backend kernel directly instead of
redispatching to it; any other key set (fake or functional tensors, modes, autocast) redispatches.
It is built on PyTorch's private dispatch API: where that is off (`csrc_free_ops.private_apis.TORCH`:
an untested PyTorch or QWEN_PRIVATE_APIS=0), ops take `torch.library.register_autograd` itself.

Launch plans (qwen_ops/plans.py), where the private PyTorch and Triton paths are on: on CUDA, after the checks and the launcher have run for a
signature (shapes, strides, dtypes, devices, alignment, scalar values), later calls with that
signature replay the recorded launches instead. `plan_tables` holds them per op.

`kernel_calls` counts the Triton launches per op, so tests can assert which path ran.
"""
import inspect
from collections import Counter
from typing import Callable, Iterable, Optional

import torch

from csrc_free_ops import private_apis
from csrc_free_ops.launch import INTERPRET, _through_triton, traced

from . import plans
from .checks import INDEX_DTYPES, KERNEL_DTYPES, fail

_lib = torch.library.Library("qwen", "FRAGMENT")

kernel_calls: Counter = Counter()
"""op name -> number of calls that took the Triton kernel (not the reference), this process."""

if private_apis.TORCH:
    _K = torch._C.DispatchKey
    PLAIN_KEYSETS = {"CPU": torch._C.DispatchKeySet(_K.CPU).add(_K.AutogradCPU),
                     "CUDA": torch._C.DispatchKeySet(_K.CUDA).add(_K.AutogradCUDA)}
    """The dispatch key sets an op's Autograd kernel sees for plain CPU / CUDA tensors: no mode,
    tensor subclass, functionalization, autocast or functorch transform in play."""
_impls: dict = {}  # op name -> {"CPU": on_cpu, "CUDA": on_cuda}
_with_backward: set = set()
"""Names of the ops `register_autograd` gave a backward; any other op refuses an input that needs a
gradient while grad mode is on (`_refuse_grad`)."""
plan_tables: dict = {}
"""op name -> its launch plans (signature -> replay function, or False where a call cannot be replayed)."""


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: fp32, or float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself when it already is (``Tensor.to`` costs a dispatcher call even then,
    which the references on the CPU path pay for every operand)."""
    return t if t.dtype == dtype else t.to(dtype)


DISPATCH_DTYPES = KERNEL_DTYPES + INDEX_DTYPES
"""Dtypes of a dispatch tensor that take the Triton kernel: the float kernel dtypes, and the index
dtypes of ops whose dispatch tensor is an index (the MoE sort's top-k ids)."""


def runs_kernels(device_type: str, dtype: torch.dtype) -> bool:
    """The dispatch rule: an op whose dispatch tensor has this device type and dtype runs its Triton
    kernel (else its PyTorch reference): on CUDA for ``DISPATCH_DTYPES``, on the CPU for those only
    under TRITON_INTERPRET=1."""
    return dtype in DISPATCH_DTYPES and (device_type == "cuda" or INTERPRET)


def _refuse_grad(name: str, args) -> None:
    """A QwenOpError when autograd would record a call of op `name`, which has no backward (PyTorch
    would run it and let its inputs' gradients silently miss it)."""
    if name not in _with_backward and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        fail(name, "has no backward, and an input requires grad: call it under torch.no_grad() or "
                   "torch.inference_mode(), or on tensors that do not require grad (docs/training.md lists "
                   "the ops with a backward)")


def define(reference: Callable, kernel: Callable, check: Callable, fake: Callable,
           mutates_args: Iterable[str] = (), dispatch_arg: int = 0, check_values: Optional[Callable] = None,
           traceable: bool = True):
    """Register torch.ops.qwen.<name> (see the module doc) and return its OpOverload.

    `dispatch_arg`: the position of the tensor whose device and dtype pick the path.
    `traceable`: torch.compile traces into the kernel launches (see `_trace_into_kernels`); False
    keeps the op opaque (ops whose launchers use state outside their arguments).
    """
    name = reference.__name__.removesuffix("_reference")
    schema = torch.library.infer_schema(reference, mutates_args=tuple(mutates_args))
    _lib.define(name + schema)
    # The dispatcher leaves out trailing arguments equal to their defaults: put them back.
    defaults = tuple(p.default for p in inspect.signature(reference).parameters.values())

    def on_cpu(*args):
        args += defaults[len(args):]
        _refuse_grad(name, args)
        check(*args)
        if check_values is not None:
            check_values(*args)
        if runs_kernels("cpu", args[dispatch_arg].dtype):
            kernel_calls[name] += 1
            return kernel(*args)
        return reference(*args)

    # Launch plans (qwen_ops/plans.py), kept where the kernels run on CUDA through launch.py's cache
    planned = traceable and not INTERPRET and private_apis.TORCH and private_apis.TRITON
    key = plans.key_function(getattr(torch.ops.qwen, name).default._schema) if planned else None
    table = plan_tables[name] = plans.PlanTable()

    def on_cuda(*args):
        args += defaults[len(args):]
        _refuse_grad(name, args)
        if key is not None and plans.enabled and not _through_triton():
            signature = key(*args)
            replay = table.get(signature)
            if replay:
                kernel_calls[name] += 1
                return replay(*args)
        else:
            signature = replay = None
        check(*args)
        t = args[dispatch_arg]
        if not runs_kernels("cuda", t.dtype):
            return reference(*args)
        kernel_calls[name] += 1
        if t.get_device() != torch._C._cuda_getDevice():
            with torch.cuda.device(t.device):  # kernels launch on the current device
                return kernel(*args)
        if replay is None and signature is not None:  # not recorded yet
            return table.record(signature, kernel, args)
        return kernel(*args)

    def fake_impl(*args):
        args += defaults[len(args):]
        _refuse_grad(name, args)
        check(*args)
        return fake(*args)

    _lib.impl(name, on_cpu, "CPU")
    _lib.impl(name, on_cuda, "CUDA")
    _impls[name] = {"CPU": on_cpu, "CUDA": on_cuda}
    torch.library.register_fake(f"qwen::{name}", fake_impl, lib=_lib)
    op = getattr(torch.ops.qwen, name).default
    if traceable:
        _trace_into_kernels(op, kernel, check, defaults, dispatch_arg)
    return op


def _symbolic(args) -> bool:
    for a in args:
        if isinstance(a, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in a.shape):
            return True
    return False


def _exporting_ops_whole() -> bool:
    """torch.export asked to keep Triton-backed ops whole (as it does for `triton_op`)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # a torch without the switch
        return False
    return custom_triton_ops_decomposition_disabled()


def _trace_into_kernels(op, kernel, check, defaults, dispatch_arg):
    """When torch.compile functionalizes a graph (AOTAutograd), replace the op by its launcher run
    on the traced tensors, its kernel launches recorded through `wrap_triton`: Inductor then
    schedules and launches the Triton kernels itself. This is what `torch.library.triton_op`
    does, on an op defined with `Library.define` (a leaner eager path than `custom_op`).

    Kept opaque (the op itself in the graph): inputs off CUDA or of a dtype the kernels do not
    take, the interpreter, symbolic shapes (dynamic-shape graphs; the launchers pick tiles from
    concrete sizes), and torch.export when it keeps such ops whole."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch._subclasses.fake_tensor import FakeTensor

    def decompose(mode, func, types, args, kwargs):
        if any(t is not torch.Tensor and not issubclass(t, (FunctionalTensor, FakeTensor)) for t in types):
            return NotImplemented
        args = tuple(args) + defaults[len(args):]
        t = args[dispatch_arg]
        if (INTERPRET or not t.is_cuda or t.dtype not in DISPATCH_DTYPES or kwargs or _symbolic(args)
                or _exporting_ops_whole()):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode, traced():
            check(*args)
            return kernel(*args)

    torch.library.register_torch_dispatch(op, FunctionalTensorMode, decompose, lib=_lib)


def register_autograd(op, backward: Callable, setup_context: Callable):
    """`torch.library.register_autograd(op, backward, setup_context=...)` with a leaner per-call
    path: without grad, one redispatch below autograd; with grad, an autograd.Function whose
    forward redispatches and calls setup_context(ctx, inputs, output) (inputs with their defaults
    filled in), and whose backward is `backward(ctx, *grads)`. Where the private dispatch API is off,
    `torch.library.register_autograd` itself."""
    _with_backward.add(op._opname)
    if not private_apis.TORCH:
        torch.library.register_autograd(op, backward, setup_context=setup_context, lib=_lib)
        return
    schema = op._schema
    if schema.is_mutable or any(a.kwarg_only or isinstance(a.type, torch._C.ListType) for a in schema.arguments):
        raise ValueError(f"register_autograd: {op} mutates an input or takes keyword-only or list arguments, "
                         "which this autograd kernel does not handle")
    defaults = tuple(a.default_value if a.has_default_value() else None for a in schema.arguments)
    below_autograd = torch._C._after_autograd_keyset

    def forward(ctx, keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = op.redispatch(keyset & below_autograd, *args)
        setup_context(ctx, args, output)
        return output

    def backward_without_keyset(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[1:]
        try:
            grads_in = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (None, *grads_in) if isinstance(grads_in, tuple) else (None, grads_in)

    function = type(f"{op._namespace}_{op._opname}_{op._overloadname}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_without_keyset)})

    direct = {PLAIN_KEYSETS[k].raw_repr(): impl for k, impl in _impls[op._opname].items()}

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(keyset, *args, *defaults[len(args):])
        impl = direct.get(keyset.raw_repr())
        with torch._C._AutoDispatchBelowAutograd():
            if impl is not None:  # plain tensors: the backend kernel itself, no second trip through the dispatcher
                return impl(*args)
            return op.redispatch(keyset & below_autograd, *args)

    _lib.impl(op._opname, autograd_kernel, "Autograd", with_keyset=True)


def last_dim_contiguous(t):
    """Kernels read rows with unit stride: gradients can arrive expanded (stride 0) or transposed."""
    return t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def no_grad_placeholder(ref: torch.Tensor) -> torch.Tensor:
    """The output a backward op gives for a gradient nobody asked for: an empty tensor."""
    return ref.new_empty((0,))
