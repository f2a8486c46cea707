"""A class of submissions on disk, as the class tests read it: a folder of ``.py`` files and its
``_expected.py`` manifest (what the instructor expects of each), loaded as modules of their own
(a submission is a file, never an importable package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_module(path: Path, name: str) -> ModuleType:
    """The module of file ``path``, under the module name ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def submissions(folder: Path) -> list[str]:
    """The submissions' file names in ``folder``, sorted (files starting with _ are not)."""
    return sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("_"))


def submission(folder: Path, name: str, prefix: str) -> ModuleType:
    """Submission ``name`` of ``folder``, as module ``{prefix}_{stem}``."""
    return load_module(folder / name, f"{prefix}_{name[:-3]}")
