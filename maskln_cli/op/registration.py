"""Defines maskln's torch ops as soon as torch is imported, without importing torch itself.

A graph saved by ``torch.export.save`` (or a traced module) holds ``maskln::masked_layer_norm``
by name, and loading it in a fresh process needs the op defined: ``import maskln_cli`` is
enough, in either order with ``import torch``. When torch is already imported the ops are
defined at once; otherwise a finder on ``sys.meta_path`` waits for torch's import and defines
them right after it, so ``maskln --help`` (which never imports torch) pays nothing.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["register_with_torch"]


def register_with_torch() -> None:
    """Define the ops now if torch is imported, else right after torch's import."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if getattr(getattr(torch, "__spec__", None), "_initializing", False):
            return  # imported from inside torch's own import: too early, and nothing to save
        _define_ops()
        return
    if not any(isinstance(finder, _AfterTorchImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


def _define_ops() -> None:
    try:
        import maskln_cli.op.library  # noqa: F401
    except Exception as error:  # never break the import of torch for its other users
        warnings.warn(
            f"maskln: its torch ops could not be defined ({type(error).__name__}: {error})",
            RuntimeWarning,
            stacklevel=2,
        )


class _AfterTorchImport:
    """A meta-path finder that finds nothing itself: when torch is about to be imported, it
    asks the finders after it for torch's spec and makes its loader define maskln's ops once
    torch's module has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once, and not in its own way below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_torch = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                run_torch(module)
            finally:
                del loader.exec_module  # type: ignore[attr-defined]  (back to the class's)
            _define_ops()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
