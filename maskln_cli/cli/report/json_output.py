"""The ``--json`` documents: indented JSON, NaN and inf as null, lists of numbers on one line."""

from __future__ import annotations

import json
import math
import sys

from maskln_cli.cli.report.consoles import closed_pipe_ends_quietly


def print_json(data: object) -> None:
    """A JSON document on stdout (plain, never styled, NaN and inf as null)."""
    with closed_pipe_ends_quietly():
        sys.stdout.write(to_json(data) + "\n")
        sys.stdout.flush()


def to_json(data: object) -> str:
    """Indented JSON, with lists of numbers (shapes, indices) kept on one line.

    Every string (a key, a metadata value) is encoded by the json module and nothing else
    touches it: ``"w[ 1,  2 ]"`` stays as it is.

    Example:
        >>> print(to_json({"shape": [2, 3], "max": float("inf"), "key": "w[ 1,  2 ]"}))
        {
          "shape": [2, 3],
          "max": null,
          "key": "w[ 1,  2 ]"
        }
    """
    return _encode(data, "")


def _encode(value: object, indent: str) -> str:
    """``json.dumps(value, indent=2)`` with NaN and inf as null, but for lists of numbers
    (and nulls), which stay on one line. Scalars are encoded as the json module encodes them
    (strings by its own encoder), without a json.dumps call each: a report of 10,000 tensors
    holds 400,000 of them."""
    kind = type(value)
    if kind is str:
        return _encode_string(value)  # type: ignore[arg-type]
    if kind is int:
        return int.__repr__(value)  # type: ignore[arg-type]
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else "null"  # type: ignore[arg-type]
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    inner = indent + "  "
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = (f"{inner}{_encode_string(str(k))}: {_encode(v, inner)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list | tuple):
        if not value:
            return "[]"
        if all(v is None or type(v) in (int, float) for v in value):  # not bool
            return "[" + ", ".join(_encode(v, inner) for v in value) + "]"
        return "[\n" + ",\n".join(inner + _encode(v, inner) for v in value) + f"\n{indent}]"
    if isinstance(value, float):
        return _encode(float(value), indent)
    return json.dumps(value)  # what the json module makes of it, or its TypeError


_encode_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
"""What json.dumps does with a string (``ensure_ascii``, the default)."""
