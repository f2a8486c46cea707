"""What runs inside the graded function, recorded: the torch ops (forward and backward, inside
a user's custom op too), the torch functions, and the Python functions of torch's own
normalizations and of maskln's op (:class:`PythonRecorder`); and which recorded names are
ready-made implementations (:func:`is_ready_made`). The raw_ops clause uses them.
"""

from __future__ import annotations

import contextvars
import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

FORBIDDEN_OPS = ("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm")
"""A torch function, or an op of torch's own (:data:`TORCH_NAMESPACES`), whose name holds one
of these is a ready-made normalization. An op of another namespace is the user's own (a
kernel author's ``mykernels::masked_layer_norm``): the grader looks inside it instead."""
TORCH_NAMESPACES = ("aten", "prims")
MASKLN_OP_PACKAGE = "op"
"""maskln's own implementations of the op (every module of ``maskln_cli.op``): calling them is
using a ready-made implementation, unless the function graded is maskln's own op
(:func:`is_maskln_function`)."""


def op_recorders():
    """The classes ``(RecordFunctions, RecordOps)``: torch modes that keep the names of the torch
    functions and of the ops that run (defined on first use, with the modes they build on)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordFunctions(TorchFunctionMode):
        """Names of the torch functions called (F.rms_norm decomposes below this level). The
        mode is off while a function runs: what a custom op's implementation calls is not seen
        here, but by RecordOps and the Python recorder."""

        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(_function_name(func))
            return func(*args, **(kwargs or {}))

    class RecordOps(TorchDispatchMode):
        """The ops that run, forward and backward; inside an op that is not torch's own (a
        ``torch.library`` custom op), the ops its implementation runs too."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Nothing is compiled here: skipping dynamo would import it (seconds) for nothing.
            return False

        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            self.names.add(name)
            kwargs = kwargs or {}
            backend = _backend_key(args, kwargs)
            if name.partition("::")[0] in TORCH_NAMESPACES or backend is None:
                return func(*args, **kwargs)
            # This mode is off while its handler runs: a custom op's implementation would run
            # unseen. Run the op's backend kernel with the mode back on (calling the op again
            # would come back here).
            with self:
                try:
                    return func.redispatch(torch._C.DispatchKeySet(backend), *args, **kwargs)
                except NotImplementedError:  # no kernel for that key: run it as it comes
                    pass
            return func(*args, **kwargs)

    return RecordFunctions, RecordOps


def _function_name(func: Any) -> str:
    """``aten::layer_norm`` for an op, ``torch.nn.functional.layer_norm`` for a function."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return str(schema.name)
    qualified = getattr(func, "_qualified_op_name", None)  # an OpOverloadPacket
    if isinstance(qualified, str):
        return qualified
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__name__", None) or repr(func)
    return f"{module}.{name}" if module else name


def _backend_key(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The dispatch key of the backend of the first tensor argument (CPU or CUDA), or None."""
    for value in itertools.chain(args, kwargs.values()):
        candidates = value if isinstance(value, list | tuple) else (value,)
        for tensor in candidates:
            if isinstance(tensor, torch.Tensor):
                kind = tensor.device.type
                return {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}.get(
                    kind
                )
    return None


def is_ready_made(name: str) -> bool:
    """Whether a recorded name is a ready-made implementation: a normalization of torch's own
    (an aten or prims op, or a torch function in C or Python, ``torch._refs`` and
    ``torch._decomp`` included, whose name holds :data:`FORBIDDEN_OPS`), or maskln's own op
    (``maskln::`` ops, functions of ``maskln_cli``: recorded only when not grading maskln's op).
    Not a user's own custom op, whatever its name.

    Example:
        >>> is_ready_made("aten::native_layer_norm"), is_ready_made("mykernels::layer_norm")
        (True, False)
        >>> is_ready_made("torch._refs.native_layer_norm"), is_ready_made("mine.layer_norm")
        (True, False)
        >>> is_ready_made("maskln_cli.op.api.masked_layer_normalization")
        True
    """
    namespace, separator, op = name.partition("::")
    if separator:
        if namespace == "maskln":
            return True
        return namespace in TORCH_NAMESPACES and any(word in op for word in FORBIDDEN_OPS)
    if name.startswith("maskln_cli."):
        return True
    module, _, function = name.rpartition(".")
    torch_own = module == "torch" or module.startswith("torch.")
    return torch_own and any(word in function for word in FORBIDDEN_OPS)


def is_maskln_function(fn: Any) -> bool:
    """Whether ``fn`` is one of maskln's own functions (its op graded in process)."""
    module = getattr(fn, "__module__", None) or ""
    return module == "maskln_cli" or module.startswith("maskln_cli.")


GRADING_MASKLN = contextvars.ContextVar("grading_maskln", default=False)
"""Set by :func:`run_clause` while maskln's own op is graded: its modules then run legitimately."""


class PythonRecorder:
    """The Python functions that run while it is on (``sys.setprofile``, this thread), kept
    when they are ready-made implementations: a function of torch's own Python code whose name
    holds :data:`FORBIDDEN_OPS` (``torch._refs.native_layer_norm``, a ``torch._decomp``
    decomposition, ``F.layer_norm``), or any function of maskln's op modules
    (:data:`MASKLN_OP_PACKAGE`) unless ``allow_maskln``. Names are ``module.function``.

    Example:
        >>> from torch._refs import native_layer_norm
        >>> with PythonRecorder() as recorder:
        ...     _ = native_layer_norm(torch.ones(2, 3), [3], None, None, 1e-5)
        >>> sorted(recorder.names)
        ['torch._refs.native_layer_norm']
    """

    def __init__(self, allow_maskln: bool = False) -> None:
        self.names: set[str] = set()
        self._torch = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
        # maskln_cli/op/, from maskln_cli/grading/clauses/recorders.py
        op = Path(__file__).resolve().parents[2] / MASKLN_OP_PACKAGE
        self._maskln = set() if allow_maskln else {str(path) for path in op.glob("*.py")}
        self._known: dict[Any, str] = {}
        self._previous: Any = None

    def __enter__(self) -> PythonRecorder:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = self._name(frame.f_code)
        if not name or name.endswith(".<module>"):  # importing maskln runs none of the op
            return
        if not (name.startswith("maskln_cli.") and self._inside_maskln(frame)):
            self.names.add(name)

    def _inside_maskln(self, frame: Any) -> bool:
        """Whether a caller of ``frame`` is in maskln's op (named already: its entry point)."""
        caller = frame.f_back
        while caller is not None:
            if self._name(caller.f_code).startswith("maskln_cli."):
                return True
            caller = caller.f_back
        return False

    def _name(self, code: Any) -> str:
        name = self._known.get(code)
        if name is None:
            name = self._known[code] = self._classify(code)
        return name

    def _classify(self, code: Any) -> str:
        path = os.path.realpath(code.co_filename)
        if path.startswith(self._torch):
            if not any(word in code.co_name for word in FORBIDDEN_OPS):
                return ""
            module = "torch/" + path[len(self._torch) :]
        elif path in self._maskln:
            module = f"maskln_cli/{MASKLN_OP_PACKAGE}/" + os.path.basename(path)
        else:
            return ""
        module = module.removesuffix(".py").removesuffix("/__init__").replace(os.sep, ".")
        return f"{module.replace('/', '.')}.{code.co_qualname}"
