"""Triton's CPU interpreter without its repeated language patching, for the test process.

A kernel launch under the interpreter patches ``triton.language`` (its builtins swapped for
interpreted ones, found by scanning the modules with ``inspect.getmembers``) and restores it after
the launch. Every call of a ``@triton.jit`` helper inside the kernel patches the same modules
again, though the launch already did: at one helper call per tile step that scan was about a
quarter of a model test's time. ``skip_nested_patches`` makes such a call skip it when the launch
in progress patched every language module the helper sees (nothing would change: the helper's
patch only reassigns what the launch assigned, and the launch's restore undoes both). Anything
else, a helper outside a launch included, patches as before. Triton versions without these
internals are left as they are.
"""
import inspect
import threading


def skip_nested_patches() -> bool:
    """Install the skip (see the module doc); whether it was installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter

        patch_lang, launch, no_changes = (interpreter._patch_lang, interpreter.GridExecutor.__call__,
                                          interpreter._LangPatchScope)
    except (ImportError, AttributeError):
        return False
    state = threading.local()
    seen: dict = {}

    def languages(fn) -> frozenset:
        """The language modules (``tl``, ``tl.core``) in ``fn``'s globals, as the patch finds them."""
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[key]

    def patch_once(fn):
        if getattr(state, "launching", False):  # the launch's own patch
            state.launching = False
            state.patched = languages(fn)
            return patch_lang(fn)
        patched = getattr(state, "patched", None)
        if patched is not None and languages(fn) <= patched:
            return no_changes()
        return patch_lang(fn)

    def launch_patching_once(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.launching = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.launching, state.patched = False, outer

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once
    return True
