"""An instructor's rules for grading a class, in one place: which clauses count (a preset, or the
required clauses listed, and extra ones), the time limit, the jobs and the seed; written once
in ``maskln-grade.toml`` beside the submissions or under ``[tool.maskln.grade]`` in a
``pyproject.toml``, or named on the command line (``--rules``). Every grade says which rule set
graded it (:attr:`Rules.name`). Reading rules imports nothing slow (no torch).

A rules file::

    # maskln-grade.toml, beside the submissions
    preset = "specification"            # or "strict"
    extra = ["positive_zero", "second_order"]
    timeout = 30                        # seconds per clause
    jobs = 2

Keys: ``preset`` (:data:`PRESETS`), ``required`` (the clauses that count, instead of the
preset's), ``extra`` (clauses that count too: strict ones, ``half``), ``timeout``, ``jobs``,
``seed``, ``name`` (how the rule set is shown; by default, where it comes from and what it
counts).

Example:
    >>> rules = parse_rules({"preset": "specification", "extra": ["second_order"]}, "x.toml")
    >>> rules.name
    'x.toml: specification + second_order'
    >>> rules.grading_options()
    {'strict': False, 'only': [], 'include': ['second_order']}
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from maskln_cli.errors import MasklnError
from maskln_cli.grading.selection import CLAUSE_LEVELS, GROUPS, select

RULES_FILE = "maskln-grade.toml"
PYPROJECT = "pyproject.toml"
PRESETS = {
    "specification": "values, shapes and gradients: the specification's required clauses",
    "strict": "the required clauses and maskln's strict guarantees but output_layout",
}
"""The rule sets a rules file (``preset``) or ``--rules`` can name."""
KEYS = ("preset", "required", "extra", "timeout", "jobs", "seed", "name")


@dataclass(frozen=True)
class Rules:
    """Which clauses count, and how a class is graded. ``source``: the file the rules come
    from (None: a preset named on the command line, or the default)."""

    preset: str = "specification"
    required: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    timeout: float | None = None
    jobs: int | None = None
    seed: int | None = None
    source: str | None = None
    title: str | None = None

    @property
    def name(self) -> str:
        """How a report shows the rule set: ``maskln-grade.toml: specification +
        positive_zero, second_order``; ``strict``; ``only values, gradients``."""
        if self.title:
            return self.title
        counted = f"only {', '.join(self.required)}" if self.required else self.preset
        if self.extra:
            counted += f" + {', '.join(self.extra)}"
        return f"{self.source}: {counted}" if self.source else counted

    def grading_options(self) -> dict[str, Any]:
        """The grader's options for these rules: ``strict``, ``only`` and ``include``."""
        if self.required:
            return {"strict": False, "only": [*self.required, *self.extra], "include": []}
        return {"strict": self.preset == "strict", "only": [], "include": list(self.extra)}

    def with_command_line(
        self, strict: bool = False, include: Sequence[str] = (), only: Sequence[str] = ()
    ) -> Rules:
        """These rules with the command line's ``--strict``, ``--with`` and ``--only`` (which
        grades those clauses alone)."""
        rules = self
        if strict and not self.required:
            rules = replace(rules, preset="strict", title=None)
        if include:
            extra = tuple(dict.fromkeys([*rules.extra, *_names(include)]))
            rules = replace(rules, extra=extra, title=None)
        if only:
            rules = replace(rules, required=tuple(_names(only)), extra=(), title=None)
        return rules


def _names(values: Sequence[str]) -> list[str]:
    from maskln_cli.grading.selection import split_names

    return split_names(values)


def parse_rules(data: dict[str, Any], source: str) -> Rules:
    """Rules from a TOML table; a usage error naming ``source`` and the key for anything
    wrong."""
    unknown = [key for key in data if key not in KEYS]
    if unknown:
        raise MasklnError(f"{source}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    preset = data.get("preset", "specification")
    if preset not in PRESETS:
        raise MasklnError(f"{source}: preset {preset!r} is not one of {', '.join(PRESETS)}")
    required = _clause_list(data, "required", source)
    extra = _clause_list(data, "extra", source)
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise MasklnError(f"{source}: name must be a string")
    rules = Rules(
        preset=preset,
        required=tuple(required),
        extra=tuple(extra),
        timeout=_number(data, "timeout", source),
        jobs=_whole(data, "jobs", source, least=1),
        seed=_whole(data, "seed", source, least=0),
        source=source,
        title=name,
    )
    try:
        select(**rules.grading_options())
    except MasklnError as error:  # a clause that cannot be counted so, said with the file
        raise MasklnError(f"{source}: {error}") from None
    return rules


def _clause_list(data: dict[str, Any], key: str, source: str) -> list[str]:
    value = data.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MasklnError(f"{source}: {key} must be a list of clause names")
    for name in value:
        if name not in CLAUSE_LEVELS and not (key == "extra" and name in GROUPS):
            raise MasklnError(
                f"{source}: {key}: no clause {name!r}; the clauses are {', '.join(CLAUSE_LEVELS)}"
            )
    return list(dict.fromkeys(value))


def _number(data: dict[str, Any], key: str, source: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MasklnError(f"{source}: {key} must be a number of seconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise MasklnError(f"{source}: {key} must be a positive number of seconds, got {value}")
    return float(value)


def _whole(data: dict[str, Any], key: str, source: str, least: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MasklnError(f"{source}: {key} must be a whole number of at least {least}")
    return value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise MasklnError(
                f"{path}: reading TOML needs Python 3.11, or the tomli package"
            ) from None
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except OSError as error:
        raise MasklnError(f"{path}: cannot read it ({error.strerror or error})") from None
    except tomllib.TOMLDecodeError as error:
        raise MasklnError(f"{path}: not valid TOML ({error})") from None


def load_rules(path: str | os.PathLike[str]) -> Rules:
    """The rules of a file: a ``maskln-grade.toml``, or a ``pyproject.toml`` (its
    ``[tool.maskln.grade]`` table, which must be there)."""
    path = Path(path)
    if not path.is_file():
        raise MasklnError(f"--rules {path}: no such file, nor a preset ({', '.join(PRESETS)})")
    data = _read_toml(path)
    if path.name == PYPROJECT:
        table = data.get("tool", {}).get("maskln", {}).get("grade")
        if not isinstance(table, dict):
            raise MasklnError(f"{path}: no [tool.maskln.grade] table")
        return parse_rules(table, f"{shown(path)} [tool.maskln.grade]")
    return parse_rules(data, shown(path))


def shown(path: str | os.PathLike[str]) -> str:
    """``path`` as a report shows it: relative to the current folder when it is below it."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith(os.pardir) else str(path)


def graded_folder(targets: Sequence[str]) -> Path | None:
    """The folder a grade is about: a folder TARGET itself, else the folder holding the file
    TARGETs (their common one); None for module targets alone."""
    folders = []
    for target in targets:
        location = target.rpartition(":")[0] if ":" in target and not os.path.exists(target) \
            else target  # fmt: skip
        if os.path.isdir(location):
            folders.append(os.path.abspath(location))
        elif location.endswith(".py") or os.path.isfile(location):
            folders.append(os.path.dirname(os.path.abspath(location)))
    if not folders:
        return None
    return Path(os.path.commonpath(folders))


def find_rules(targets: Sequence[str]) -> Rules | None:
    """The rules beside the submissions: ``maskln-grade.toml`` in the folder graded, else the
    ``[tool.maskln.grade]`` of the nearest ``pyproject.toml`` from it upward (the first found
    decides: one without the table means no rules)."""
    folder = graded_folder(targets)
    if folder is None:
        return None
    beside = folder / RULES_FILE
    if beside.is_file():
        return load_rules(beside)
    for parent in (folder, *folder.parents):
        pyproject = parent / PYPROJECT
        if pyproject.is_file():
            table = _read_toml(pyproject).get("tool", {}).get("maskln", {}).get("grade")
            if isinstance(table, dict):
                return parse_rules(table, f"{shown(pyproject)} [tool.maskln.grade]")
            return None
    return None


def resolve_rules(option: str | None, targets: Sequence[str]) -> Rules:
    """The rules a grade uses: ``--rules`` (a preset's name or a file), else the rules found
    beside the submissions (:func:`find_rules`), else the specification's."""
    if option is not None:
        if option in PRESETS and not os.path.exists(option):
            return Rules(preset=option)
        return load_rules(option)
    return find_rules(targets) or Rules()
