"""The Triton interpreter (TRITON_INTERPRET=1) without its repeated language patching.

A kernel launch under the interpreter patches `triton.language` (its builtins become calls into the interpreter)
for the launch and restores it afterwards. Triton's interpreter also patches it again at every call of a
`@triton.jit` helper inside the kernel (`InterpretedFunction.__call__` -> `_patch_lang`: `inspect.getmembers` over
the language modules), per program of the grid. While the launch's patch is in place that repeated patch changes
nothing (only builtins are replaced, and they already are), but it took about a third of the interpreter tests'
time (e.g. 82 s of 232 s for LoLA's decode through a tiny model). `skip_repeated_language_patch` makes a helper's
call patch only the language modules that are not patched yet: the same semantics, computed once per launch.
`tests/test_triton_interpreter.py` checks that kernels with helpers give the same bits either way.
"""

from __future__ import annotations

import functools
import inspect


def _languages(fn) -> list:
    """The language modules visible from a jit function's globals (what `_patch_lang` patches)."""
    import triton.language as tl

    return [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]


def skip_repeated_language_patch() -> bool:
    """Install the shortcut in Triton's interpreter; False (nothing changed) where its structure is not the one
    this was written for (another Triton version): the tests then run at the interpreter's own speed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    fn_cls = getattr(interp, "InterpretedFunction", None)
    call = getattr(fn_cls, "__call__", None)
    if fn_cls is None or call is None or not hasattr(interp, "_patch_lang") or getattr(call, "_shortcut", False):
        return False
    try:
        src = inspect.getsource(call)
    except (OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in src or "self.rewrite()" not in src:
        return False
    langs_of: dict = {}

    def patched(lang) -> bool:
        return not tl.core.is_builtin(getattr(lang, "program_id", None))

    @functools.wraps(call)
    def device_call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = _languages(self.fn)
        if not langs or not all(patched(lang) for lang in langs):
            interp._patch_lang(self.fn)  # as Triton does (no launch in progress has patched these modules)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    device_call._shortcut = True
    device_call._original = call
    fn_cls.__call__ = device_call
    return True


def restore() -> None:
    """Triton's own device-function call back (for the check that compares both)."""
    from triton.runtime import interpreter as interp

    call = interp.InterpretedFunction.__call__
    if getattr(call, "_shortcut", False):
        interp.InterpretedFunction.__call__ = call._original
