"""Test setup: without a GPU the Triton kernels run on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
The interpreter skips re-patching triton.language at each helper call (tests/fast_interpreter.py).
flash-linear-attention, if installed, is hidden from transformers (below).
Tests marked `cuda` need a GPU and are skipped without one.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers is the oracle of the model tests, run in fp32 through its own PyTorch code. With
# flash-linear-attention importable, its Qwen3.5 Gated DeltaNet layers would call that library's
# Triton kernels instead, which are not fp32-exact: the fp32 parity tests failed at 5e-3 with it.
# Hidden before transformers is imported, so it keeps its fallbacks.
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.fast_interpreter import skip_nested_patches

    skip_nested_patches()


@pytest.fixture(autouse=True)
def _cpu_op_tests_run_the_kernels(request):
    """An op test's CPU case under the interpreter must launch a Triton kernel: without this, a
    dispatch bug routing CPU tensors to the references would turn CI into a test of the
    references against themselves."""
    callspec = getattr(request.node, "callspec", None)
    checked = (os.environ.get("TRITON_INTERPRET") == "1" and request.module.__name__.split(".")[-1].startswith(("test_ops_", "test_training_ops"))
               and callspec is not None and callspec.params.get("device") == "cpu"
               and request.node.get_closest_marker("launcher") is None)
    if not checked:
        yield
        return
    from qwen_ops import kernel_calls

    before = sum(kernel_calls.values())
    yield
    assert sum(kernel_calls.values()) > before, "the test ran no Triton kernel (did the op take its reference?)"


@pytest.fixture(autouse=True)
def _give_back_cuda_memory():
    """After each test the caching allocator gives its free blocks back to the GPU: ``bench.cuda_suite``
    runs several pytest processes on one GPU, and a process that kept the peak of its largest test
    would starve the others (and the subprocesses of the tests at model shapes)."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float tensor torch.empty allocates during the test starts as NaN, so an output or
    scratch element a kernel forgets to write (or reads before writing) shows up, on CPU too."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (realistic shapes); skipped without one")
    config.addinivalue_line("markers", "launcher: calls a csrc_free_ops launcher directly (not through an op)")


def pytest_collection_modifyitems(config, items):
    """No GPU: skip `cuda` tests. A GPU and no interpreter: skip the kernel tests' CPU cases,
    since CPU tensors would take the PyTorch reference and compare it with itself."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        on_cpu = getattr(item, "callspec", None) is not None and item.callspec.params.get("device") == "cpu"
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif on_cpu and not interpret:
            item.add_marker(pytest.mark.skip(reason="CPU runs the reference unless TRITON_INTERPRET=1"))


_TEST_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    """With QWEN_TEST_TIMES set (``bench.cuda_suite`` sets it per process), each test's seconds
    (setup, call and teardown) are appended to that file as it ends, and with QWEN_TEST_FAILURES a
    failed phase's report to that one as it fails: a run cut short keeps them."""
    failures = os.environ.get("QWEN_TEST_FAILURES")
    if failures and report.failed:
        with open(failures, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
    path = os.environ.get("QWEN_TEST_TIMES")
    if not path:
        return
    _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        with open(path, "a") as f:
            f.write(f"{_TEST_SECONDS.pop(report.nodeid):.2f}\t{report.nodeid}\n")
