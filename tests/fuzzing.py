"""Helpers for tests/test_fuzz.py: build, mutate and check safetensors files, and run maskln safely.

A safetensors file is an 8-byte little-endian u64 N, N bytes of JSON (the header), then the data
buffer; each header entry is ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets
relative to the buffer, and ``"__metadata__"`` maps strings to strings.

A :class:`Layout` is a parsed file (entries in buffer order, metadata) that re-serializes to a
consistent file; :class:`Pairs` is a JSON object that may hold duplicate keys, so the header
can be mutated structurally (keys dropped, duplicated, of the wrong type) and written back.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from hypothesis import strategies as st

from tests.clitools import ROOT, invoke

# --- the format ---------------------------------------------------------------------------------

# Element sizes in bits of every dtype code safetensors knows (F4 and F6 are sub-byte).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "C64": torch.complex64, "I64": torch.int64,
    "U64": torch.uint64, "F64": torch.float64, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip
FLOAT_CODES = ("F16", "BF16", "F32", "F64")


def nbytes(dtype: str, shape: list[int]) -> int | None:
    """Bytes a tensor takes, or None for an unknown dtype or an impossible shape."""
    bits = DTYPE_BITS.get(dtype)
    if bits is None or any(not isinstance(s, int) or s < 0 for s in shape):
        return None
    total = bits * math.prod(shape)
    return total // 8 if total % 8 == 0 else None


class Pairs(list):
    """A JSON object as a list of (key, value) pairs: keys may repeat, order is kept."""

    def get(self, key, default=None):
        for k, v in reversed(self):
            if k == key:
                return v
        return default


@dataclasses.dataclass(frozen=True)
class Raw:
    """Bytes pasted verbatim into the JSON text (invalid UTF-8, bad syntax, deep nesting)."""

    data: bytes


def encode_json(value: object) -> bytes:
    """JSON text for ``value``: Pairs and dicts are objects, Raw is pasted as is."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Pairs | dict):
        items = value if isinstance(value, Pairs) else list(value.items())
        inner = b",".join(encode_json(k) + b":" + encode_json(v) for k, v in items)
        return b"{" + inner + b"}"
    if isinstance(value, list | tuple):
        return b"[" + b",".join(encode_json(v) for v in value) + b"]"
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: b"1e999", -math.inf: b"-1e999"}.get(value, b"NaN")
    return json.dumps(value).encode()


def assemble(header: bytes, data: bytes, pad: bool = True, length: int | None = None) -> bytes:
    """8-byte length, header (space-padded to 8 bytes when ``pad``), data."""
    if pad:
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if length is None else length) + header + data


@dataclasses.dataclass
class Entry:
    name: str
    dtype: str
    shape: list[int]
    data: bytes


@dataclasses.dataclass
class Layout:
    """A file as entries (in buffer order) and metadata; serializes to a consistent file."""

    entries: list[Entry]
    metadata: dict[str, str] | None

    @classmethod
    def parse(cls, blob: bytes) -> Layout:
        (length,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + length])
        buffer = blob[8 + length :]
        metadata = header.pop("__metadata__", None)
        entries = [
            Entry(name, info["dtype"], list(info["shape"]), buffer[slice(*info["data_offsets"])])
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
        ]
        return cls(entries, metadata)

    def header_pairs(self, order: list[int] | None = None) -> tuple[Pairs, bytes]:
        """The header as Pairs (entries in ``order``, default buffer order) and the buffer."""
        pairs = Pairs()
        if self.metadata is not None:
            pairs.append(("__metadata__", dict(self.metadata)))
        offset, chunks, infos = 0, [], {}
        for index, entry in enumerate(self.entries):
            info = Pairs(
                [
                    ("dtype", entry.dtype),
                    ("shape", list(entry.shape)),
                    ("data_offsets", [offset, offset + len(entry.data)]),
                ]
            )
            infos[index] = (entry.name, info)
            chunks.append(entry.data)
            offset += len(entry.data)
        for index in order if order is not None else range(len(self.entries)):
            pairs.append(infos[index])
        return pairs, b"".join(chunks)

    def to_bytes(self) -> bytes:
        pairs, data = self.header_pairs()
        return assemble(encode_json(pairs), data)

    def find(self, name: str) -> Entry | None:
        return next((e for e in self.entries if e.name == name), None)


# --- valid starting files -----------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def base_tensors() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str] | None]]:
    """Small valid inputs covering the file conventions (dtypes, defaults, grad_out, empties)."""
    g = torch.Generator().manual_seed(1234)
    bases: dict[str, tuple[dict[str, torch.Tensor], dict[str, str] | None]] = {}

    x = torch.randn(3, 4, 8, generator=g)
    valid = torch.rand(3, 4, generator=g) > 0.3
    valid[0, 0], valid[0, 1] = True, False
    x[~valid] = torch.tensor([math.nan, math.inf, -math.inf, 1e30])[torch.arange(8) % 4]
    x[0, 0] = 3.0  # a constant valid row: its variance is exactly 0, so only eps is left
    scale, bias = torch.randn(8, generator=g), torch.randn(8, generator=g)
    bases["f32"] = ({"x": x, "valid": valid, "scale": scale, "bias": bias}, {"eps": "1e-05"})
    bases["f32_grad"] = (
        {**bases["f32"][0], "grad_out": torch.randn(3, 4, 8, generator=g)},
        {"eps": "1e-05"},
    )
    bases["f64_u8"] = (
        {
            "x": torch.randn(2, 5, generator=g, dtype=torch.float64) * 100 + 1e4,
            "valid": torch.tensor([1, 0], dtype=torch.uint8),
            "scale": torch.randn(5, generator=g, dtype=torch.float64),
            "bias": torch.randn(5, generator=g, dtype=torch.float64),
        },
        None,
    )
    bases["f16_defaults"] = (
        {
            "x": torch.randn(2, 3, 4, generator=g).half(),
            "grad_out": torch.randn(2, 3, 4, generator=g).half(),
        },
        {"eps": "0.001"},
    )
    bases["bf16_i64"] = (
        {
            "x": torch.cat([torch.zeros(1, 8), torch.randn(3, 8, generator=g)]).bfloat16(),
            "valid": torch.tensor([1, 1, 0, 1]),
            "scale": torch.randn(8, generator=g).bfloat16(),
            "bias": torch.randn(8, generator=g).bfloat16(),
        },
        {"eps": "1e-05", "note": "bf16"},
    )
    bases["empty_rows"] = (
        {
            "x": torch.zeros(0, 8),
            "valid": torch.zeros(0, dtype=torch.bool),
            "scale": torch.ones(8),
            "bias": torch.zeros(8),
        },
        {"eps": "1e-05"},
    )
    bases["one_channel"] = (
        {
            "x": torch.randn(5, 1, generator=g),
            "valid": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]),
            "scale": torch.ones(1) * 2,
            "bias": torch.ones(1) * 0.5,
        },
        {"eps": "0.5"},
    )
    return bases


def save_base(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


# --- strategies ---------------------------------------------------------------------------------

INTERESTING_NAMES = [
    "x", "valid", "scale", "bias", "grad_out", "out", "grad_x", "__metadata__", "", " ", "x ",
    "X", "x\x00", "x\n", "\x1b[2Jx", "[bold]x[/bold]", "\u202ex", "\u2028", "é", "💥",
    "a" * 1000, "../x", "-",
]  # fmt: skip
WEIRD_DTYPES = [
    "f32", "F32 ", "", "FLOAT32", "U1", "C128", "F128", "Q4_0", "E8M0", "null", "F8",
    "I128", "BOOL\x00", "F32\u0000",
]  # fmt: skip
EPS_TEXTS = [
    "1e-05", "0.5", "1", "3", " 1e-5 ", "1_0", "0", "-0.0", "-1e-05", "nan", "NaN", "-nan",
    "inf", "-inf", "Infinity", "", " ", "abc", "1e400", "1e-400", "5e-324", "1e-50", "1e-40",
    "1e-38", "1e-30", "1e30", "1e38", "1e39", "1e300", "0x10", "1,5", "\u0661", "1e-05\x00",
    "\x1b[31m1", "1e-05 junk", "9" * 400, "1" + "0" * 10000, "e" * 10000, "(1)", "True",
]  # fmt: skip
HEADER_LENGTHS = [0, 1, 2, 7, 8, 2**31, 2**32, 2**32 + 8, 2**62, 2**63, 2**64 - 1, 100_000_001]


def garbage_values(max_leaves: int = 6) -> st.SearchStrategy:
    """JSON-ish values of any type, nested a little."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**65), 2**65),
        st.sampled_from([0, 1, -1, 2**63, 2**64, 2**64 - 1, 2**53 + 1]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.sampled_from(["F32", "BOOL", "x", "__metadata__"]),
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=max_leaves,
    )


def shapes_for(entry: Entry) -> st.SearchStrategy[list[int]]:
    """Shapes to try on an entry: wrong products, zero sizes, 0-d, extra or fewer axes, huge."""
    shape = entry.shape
    options = [
        st.just([]),
        st.just([0]),
        st.just(shape[::-1]),
        st.just([*shape, 1]),
        st.just([1, *shape]),
        st.just(shape[:-1]),
        st.just(shape[1:]),
        st.just([*shape[:-1], 0]),
        st.just([0, *shape[1:]]),
        st.just([2**40, 8]),
        st.just([0, 2**40]),
        st.just([2**31, 0]),
        st.just([0, 2**31]),
        st.just([2**62, 2**62, 0]),
        st.lists(st.integers(0, 9), min_size=0, max_size=4),
    ]
    if shape:
        options.append(st.just([*shape[:-1], shape[-1] + 1]))
        options.append(st.just([math.prod(shape)]))
    return st.one_of(options)


def fill_bytes(entry: Entry, size: int, draw) -> bytes:
    """``size`` bytes for a resized or retyped entry: its old bytes cycled, zeros, or random
    (or its old bytes as they are, when ``size`` is too big to write out)."""
    how = draw(st.sampled_from(["cycle", "zeros", "ones", "random", "values"]))
    if size > 1 << 16:
        return entry.data  # too big to write out: the header will not match the data
    if size > 512 and how in ("random", "values"):
        how = "cycle"  # keep hypothesis' choice sequences small
    if how == "cycle" and entry.data:
        return (entry.data * (size // max(1, len(entry.data)) + 1))[:size]
    if how == "random":
        return draw(st.binary(min_size=size, max_size=size))
    if how == "ones":
        return b"\x01" * size
    if how == "values" and entry.dtype in TORCH_DTYPES and size:
        return special_values(entry.dtype, size, draw) or b"\0" * size
    return b"\0" * size


SPECIALS = [0.0, -0.0, 1.0, 2.0, -1.0, 0.5, math.nan, math.inf, -math.inf, 1e30, -1e30, 1e-30,
            65504.0, 3e38, 1e-45, 255.0, 1e4]  # fmt: skip


def special_values(dtype: str, size: int, draw) -> bytes | None:
    torch_dtype = TORCH_DTYPES[dtype]
    element = torch.empty((), dtype=torch_dtype).element_size()
    if size % element:
        return None
    count = size // element
    values = draw(st.lists(st.sampled_from(SPECIALS), min_size=count, max_size=count))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tensor = torch.tensor(values, dtype=torch.float64)
            if not (torch_dtype.is_floating_point or torch_dtype.is_complex):
                tensor = torch.nan_to_num(tensor).clamp(-(2**31), 2**31).trunc()
                if torch_dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
                    tensor = tensor.abs()
            return _tensor_bytes(tensor.to(torch_dtype))
        except (RuntimeError, TypeError, OverflowError):
            return None


@dataclasses.dataclass
class Case:
    """A mutated file and the steps that made it (shown when hypothesis reports a failure)."""

    base: str
    steps: list[str]
    data: bytes

    def __repr__(self) -> str:
        shown = self.data if len(self.data) <= 4096 else self.data[:4096] + b"...(truncated)"
        lines = [f"Case(base={self.base!r}, {len(self.data)} bytes, steps:"]
        lines += [f"    {step}" for step in self.steps]
        lines.append(f"  data={shown!r})")
        return "\n".join(lines)


def _choose_entry(draw, layout: Layout) -> Entry | None:
    if not layout.entries:
        return None
    return draw(st.sampled_from(layout.entries))


def mutate_layout(draw, layout: Layout, steps: list[str]) -> None:
    """One semantic mutation that keeps the file consistent (it still parses as safetensors)."""
    kind = draw(
        st.sampled_from(
            ["dtype", "shape", "values", "rename", "drop", "add", "eps", "metadata", "reorder"]
        )
    )
    entry = _choose_entry(draw, layout)
    if kind == "eps" or entry is None:
        text = draw(st.sampled_from(EPS_TEXTS) | st.text(max_size=12))
        if draw(st.booleans()) and layout.metadata and "eps" in layout.metadata:
            layout.metadata.pop("eps")
            steps.append("metadata: drop 'eps'")
        else:
            layout.metadata = {**(layout.metadata or {}), "eps": text}
            steps.append(f"metadata: eps = {text!r}")
    elif kind == "metadata":
        choice = draw(st.sampled_from(["none", "empty", "key", "big", "many"]))
        if choice == "none":
            layout.metadata = None
        elif choice == "empty":
            layout.metadata = {}
        elif choice == "key":
            key = draw(st.sampled_from(["eps\x00", "\x1b[2J", "eps\n", "", "EPS", "eps "]))
            value = draw(st.sampled_from(["1e-05", "nan", "\x1b[31m", "x" * 10_000]))
            layout.metadata = {**(layout.metadata or {}), key: value}
        elif choice == "big":
            layout.metadata = {**(layout.metadata or {}), "eps": "1" * 10_000}
        else:
            layout.metadata = {f"k{i}": "v" * i for i in range(300)}
        steps.append(f"metadata: {choice} -> {repr(layout.metadata)[:120]}")
    elif kind == "dtype":
        code = draw(st.sampled_from(sorted(DTYPE_BITS)))
        size = nbytes(code, entry.shape)
        old = entry.dtype
        entry.dtype = code
        if code == "F4" and entry.shape and draw(st.booleans()):
            # torch holds F4 as float4_e2m1fn_x2, two per element: [..., 2C] loads as [..., C].
            entry.shape = [*entry.shape[:-1], 2 * entry.shape[-1]]
            size = nbytes(code, entry.shape)
        if size is None:  # sub-byte dtype with an odd count: give it a shape that fits
            entry.shape = [8]
            size = nbytes(code, entry.shape)
        entry.data = fill_bytes(entry, size, draw)
        steps.append(f"{entry.name!r}: dtype {old} -> {code} {entry.shape} ({size} bytes)")
    elif kind == "shape":
        shape = draw(shapes_for(entry))
        size = nbytes(entry.dtype, shape)
        if size is not None and size <= 1 << 16:
            entry.data = fill_bytes(entry, size, draw)
        steps.append(f"{entry.name!r}: shape {entry.shape} -> {shape} ({len(entry.data)} bytes)")
        entry.shape = shape
    elif kind == "values":
        entry.data = fill_bytes(entry, len(entry.data), draw)
        steps.append(f"{entry.name!r}: new values {entry.data[:64]!r}")
    elif kind == "rename":
        name = draw(st.sampled_from(INTERESTING_NAMES) | st.text(max_size=6))
        steps.append(f"rename {entry.name!r} -> {name!r}")
        entry.name = name
    elif kind == "drop":
        layout.entries.remove(entry)
        steps.append(f"drop {entry.name!r}")
    elif kind == "add":
        name = draw(st.sampled_from([*INTERESTING_NAMES, "extra", "other.weight"]))
        code = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = nbytes(code, shape)
        if size is None:
            shape, size = [8], nbytes(code, [8])
        added = Entry(name, code, shape, b"")
        added.data = fill_bytes(added, size, draw)
        layout.entries.insert(draw(st.integers(0, len(layout.entries))), added)
        steps.append(f"add {name!r} {code} {shape}")
    else:  # reorder the data buffer
        order = draw(st.permutations(range(len(layout.entries))))
        layout.entries = [layout.entries[i] for i in order]
        steps.append(f"reorder data as {list(order)}")


def _field_position(info: Pairs, field: str) -> int:
    """Where ``field`` is in an entry; appended (as null) when an earlier mutation dropped it."""
    for index, (key, _) in enumerate(info):
        if key == field:
            return index
    info.append((field, None))
    return len(info) - 1


def _offsets(info: Pairs) -> tuple[int, int]:
    value = info.get("data_offsets")
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return 0, 0


def mutate_header(draw, pairs: Pairs, steps: list[str]) -> object:
    """One structural mutation of the header's JSON; returns the (possibly replaced) header."""
    tensors = [i for i, (k, v) in enumerate(pairs) if isinstance(v, Pairs)]
    kind = draw(
        st.sampled_from(
            ["field", "offsets", "dup_key", "drop_key", "top", "deep", "bad_utf8", "escape",
             "metadata_type", "garbage_entry", "extra_field"]
        )
    )  # fmt: skip
    if kind in ("field", "offsets", "extra_field", "dup_key") and not tensors:
        kind = "garbage_entry"
    if kind == "field":
        index = draw(st.sampled_from(tensors))
        name, info = pairs[index]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        action = draw(st.sampled_from(["drop", "dup", "garbage", "weird_dtype"]))
        position = _field_position(info, field)
        if action == "drop":
            del info[position]
        elif action == "dup":
            info.insert(position + 1, (field, draw(garbage_values()) if draw(st.booleans())
                                       else info[position][1]))  # fmt: skip
        elif action == "weird_dtype" and field == "dtype":
            info[position] = ("dtype", draw(st.sampled_from(WEIRD_DTYPES)))
        else:
            info[position] = (field, draw(garbage_values()))
        steps.append(f"header[{name!r}].{field}: {action} -> {info!r}"[:300])
    elif kind == "offsets":
        index = draw(st.sampled_from(tensors))
        name, info = pairs[index]
        begin, end = _offsets(info)
        total = max((_offsets(v)[1] for _, v in pairs if isinstance(v, Pairs)), default=0)
        choice = draw(
            st.sampled_from(["reverse", "shift", "overlap", "beyond", "huge", "negative", "hole",
                             "float", "three", "nudge"])
        )  # fmt: skip
        offsets = {
            "reverse": [end, begin],
            "shift": [begin + 4, end + 4],
            "overlap": [max(0, begin - 4), end - 4 if end >= 4 else end],
            "beyond": [begin, total + 64],
            "huge": [begin, 2**64 - 1],
            "negative": [-4, end],
            "hole": [begin + 8, end + 8],
            "float": [float(begin), float(end)],
            "three": [begin, end, end],
            "nudge": [begin, end + draw(st.integers(-3, 3))],
        }[choice]
        info[_field_position(info, "data_offsets")] = ("data_offsets", offsets)
        steps.append(f"header[{name!r}].data_offsets: {choice} -> {offsets}")
    elif kind == "dup_key":
        index = draw(st.sampled_from(tensors))
        name, info = pairs[index]
        twin = copy.deepcopy(info) if draw(st.booleans()) else draw(garbage_values())
        pairs.insert(draw(st.integers(0, len(pairs))), (name, twin))
        steps.append(f"header: duplicate key {name!r} = {twin!r}"[:300])
    elif kind == "drop_key" and pairs:
        index = draw(st.integers(0, len(pairs) - 1))
        steps.append(f"header: drop key {pairs[index][0]!r}")
        del pairs[index]
    elif kind == "top":
        replacement = draw(
            st.sampled_from([Raw(b"[]"), Raw(b"[1,2]"), Raw(b"null"), Raw(b'"x"'), Raw(b"1"),
                             Raw(b""), Raw(b"{"), Raw(b"}"), Raw(b"{}"), Raw(b"{}{}"),
                             Raw(b"\xef\xbb\xbf{}"), Raw(b" {}"), Raw(b"{} x"),
                             [pairs], Raw(b"{\"a\":1,}"), Raw(b"{'a':1}")])
        )  # fmt: skip
        steps.append(f"header: replaced by {replacement!r}"[:300])
        return replacement
    elif kind == "deep":
        depth = draw(st.sampled_from([64, 127, 128, 129, 1000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        where = draw(st.sampled_from(["metadata", "tensor", "shape"]))
        deep = Raw(opener * depth + b"1" + closer * depth)
        if where == "shape" and tensors:
            info = pairs[draw(st.sampled_from(tensors))][1]
            info[_field_position(info, "shape")] = ("shape", deep)
        elif where == "tensor":
            pairs.append(("deep", deep))
        else:
            pairs.insert(0, ("__metadata__", Pairs([("eps", deep)])))
        steps.append(f"header: nesting {depth} deep ({opener!r}) in {where}")
    elif kind == "bad_utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80",
                                     b"\xf4\x90\x80\x80", b"\x00"]))  # fmt: skip
        if tensors and draw(st.booleans()):
            index = draw(st.sampled_from(tensors))
            name, info = pairs[index]
            text = name.encode("utf-8", "surrogatepass") if isinstance(name, str) else b"x"
            pairs[index] = (Raw(b'"' + text + junk + b'"'), info)
        else:
            pairs.insert(0, ("__metadata__", Pairs([("eps", Raw(b'"1e-05' + junk + b'"'))])))
        steps.append(f"header: invalid UTF-8 {junk!r} in a string")
    elif kind == "escape":
        text = draw(st.sampled_from([rb'"\ud800"', rb'"\udc00x"', rb'"\u0000"', rb'"\x41"',
                                     rb'"\u00"', rb'"x\"', b'"\t"']))  # fmt: skip
        if tensors and draw(st.booleans()):
            index = draw(st.sampled_from(tensors))
            pairs[index] = (Raw(text), pairs[index][1])
        else:
            pairs.insert(0, ("__metadata__", Pairs([("eps", Raw(text))])))
        steps.append(f"header: escape {text!r}")
    elif kind == "metadata_type":
        value = draw(
            st.sampled_from([[], 1, None, "1e-05", {"eps": 1e-5}, {"eps": None}, {"eps": ["1"]},
                             {"eps": {"v": "1"}}, {"eps": True}])
        )  # fmt: skip
        pairs.insert(0, ("__metadata__", value))
        steps.append(f"header: __metadata__ = {value!r}")
    elif kind == "extra_field":
        index = draw(st.sampled_from(tensors))
        name, info = pairs[index]
        info.append((draw(st.sampled_from(["extra", "dtype ", "", "data_offsets\x00"])),
                     draw(garbage_values())))  # fmt: skip
        steps.append(f"header[{name!r}]: extra field -> {info!r}"[:300])
    else:  # a garbage entry
        name = draw(st.sampled_from(INTERESTING_NAMES))
        value = draw(garbage_values())
        pairs.insert(draw(st.integers(0, len(pairs))), (name, value))
        steps.append(f"header: add {name!r} = {value!r}"[:300])
    return pairs


def mutate_bytes(draw, blob: bytes, header_end: int, steps: list[str]) -> bytes:
    """One raw mutation: the length field, truncation, appended bytes, flips, inserts."""
    kind = draw(
        st.sampled_from(["length", "truncate", "append", "flip", "flip_data", "insert", "delete"])
    )
    size = len(blob)
    if kind == "length":
        true_length = header_end - 8
        value = draw(
            st.sampled_from(HEADER_LENGTHS)
            | st.integers(0, 2**64 - 1)
            | st.integers(-8, 8).map(lambda d: max(0, true_length + d))
            | st.just(size)
            | st.just(max(0, size - 8))
            | st.just(size - 7)
        )
        steps.append(f"header length {true_length} -> {value}")
        return struct.pack("<Q", value % 2**64) + blob[8:]
    if kind == "truncate":
        cut = draw(
            st.integers(0, size) | st.sampled_from([0, 1, 7, 8, 9, header_end - 1, header_end,
                                                    header_end + 1, size - 1])
        )  # fmt: skip
        cut = min(max(cut, 0), size)
        steps.append(f"truncate at {cut} of {size}")
        return blob[:cut]
    if kind == "append":
        extra = draw(st.binary(min_size=1, max_size=64) | st.just(b"\0" * 4096))
        steps.append(f"append {len(extra)} bytes {extra[:16]!r}")
        return blob + extra
    if kind in ("flip", "flip_data") and size:
        low = header_end if kind == "flip_data" and header_end < size else 0
        flips = draw(st.lists(st.tuples(st.integers(low, size - 1), st.integers(1, 255)),
                              min_size=1, max_size=4))  # fmt: skip
        data = bytearray(blob)
        for position, mask in flips:
            data[position] ^= mask
        steps.append(f"xor bytes {flips}")
        return bytes(data)
    if kind == "insert":
        position = draw(st.integers(0, size))
        junk = draw(st.binary(min_size=1, max_size=4))
        steps.append(f"insert {junk!r} at {position}")
        return blob[:position] + junk + blob[position:]
    if size:
        position = draw(st.integers(0, size - 1))
        steps.append(f"delete byte {position}")
        return blob[:position] + blob[position + 1 :]
    return blob


class Bases(dict):
    """The base layouts by name (a short repr keeps hypothesis' reports readable)."""

    def __repr__(self) -> str:
        return f"Bases({', '.join(self)})"


@st.composite
def mutated_files(draw, layouts: Bases) -> Case:
    """A valid base file with a few semantic, structural and byte-level mutations."""
    base = draw(st.sampled_from(sorted(layouts)))
    layout = copy.deepcopy(layouts[base])
    steps: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        mutate_layout(draw, layout, steps)
    order = None
    if layout.entries and draw(st.integers(0, 5)) == 0:
        order = list(draw(st.permutations(range(len(layout.entries)))))
        steps.append(f"header order {order}")
    pairs, data = layout.header_pairs(order)
    header: object = pairs
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        if not isinstance(header, Pairs):
            break
        header = mutate_header(draw, header, steps)
    pad = draw(st.sampled_from([True, True, True, False]))
    if not pad:
        steps.append("header not padded to 8 bytes")
    text = encode_json(header)
    blob = assemble(text, data, pad)
    header_end = len(blob) - len(data)
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 1, 2]))):
        blob = mutate_bytes(draw, blob, header_end, steps)
    return Case(base, steps, blob)


# --- running maskln -----------------------------------------------------------------------------

MEMORY_HEADROOM = 4 * 2**30
"""An in-process run may map at most this much more address space than the test process has."""
INVOKE_TIMEOUT = 30
SUBPROCESS_TIMEOUT = 120
SUBPROCESS_MEMORY = 8 * 2**30


class Hang(BaseException):
    """maskln ran longer than INVOKE_TIMEOUT seconds in-process."""


@dataclasses.dataclass
class Outcome:
    args: list[str]
    exit_code: int
    stdout: bytes
    stderr: str
    exception: BaseException | None
    traceback: str
    warnings: list[str]

    def describe(self) -> str:
        return (
            f"maskln {' '.join(self.args)} -> exit {self.exit_code}\n"
            f"stderr: {self.stderr!r}\n"
            f"warnings: {self.warnings}\n"
            f"{self.traceback}"
        )


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def bounded(seconds: float = INVOKE_TIMEOUT, headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Raise Hang after ``seconds``; cap the address space at current + ``headroom``."""

    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _maskln_traceback(exc_info) -> str:
    """The traceback's frames in maskln_cli (the CLI framework's are noise), and the error."""
    _, error, tb = exc_info
    frames = [f for f in traceback.extract_tb(tb) if "maskln_cli" in f.filename] or (
        traceback.extract_tb(tb)[-3:]
    )
    lines = ["Traceback (maskln_cli frames only):\n", *traceback.format_list(frames)]
    return "".join(lines + traceback.format_exception_only(type(error), error))


def run_in_process(*args: object, input: bytes | None = None, spool_dir: Path) -> Outcome:
    """``maskln ARGS`` through tests.clitools.invoke, bounded in time and memory.

    ``spool_dir`` becomes TMPDIR (stdin is spooled there), and must be empty afterwards.
    """
    saved_tempdir = tempfile.tempdir
    tempfile.tempdir = str(spool_dir)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with bounded():
                result = invoke(*args, input=input)
    finally:
        tempfile.tempdir = saved_tempdir
    trace = ""
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        trace = _maskln_traceback(result.exc_info)
    leftovers = sorted(os.listdir(spool_dir))
    outcome = Outcome(
        [str(a) for a in args],
        result.exit_code,
        result.stdout_bytes,
        result.stderr,
        result.exception,
        trace,
        [f"{w.category.__name__}: {w.message}" for w in caught],
    )
    assert not leftovers, f"stdin spool left in TMPDIR: {leftovers}\n{outcome.describe()}"
    return outcome


def run_subprocess(*args: object, input: bytes | None = None, tmpdir: Path) -> Outcome:
    """The real entry point (``python -m maskln_cli``), with a timeout and a memory cap."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (SUBPROCESS_MEMORY, SUBPROCESS_MEMORY))

    try:
        completed = subprocess.run(
            [sys.executable, "-m", "maskln_cli", *map(str, args)],
            input=input if input is not None else b"",
            capture_output=True,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "200", "TMPDIR": str(tmpdir)},
            timeout=SUBPROCESS_TIMEOUT,
            preexec_fn=limit_memory,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"maskln {args} hung for {SUBPROCESS_TIMEOUT} s") from expired
    leftovers = sorted(os.listdir(tmpdir))
    outcome = Outcome(
        [str(a) for a in args],
        completed.returncode,
        completed.stdout,
        completed.stderr.decode("utf-8", "replace"),
        None,
        "",
        [],
    )
    assert not leftovers, f"stdin spool left in TMPDIR: {leftovers}\n{outcome.describe()}"
    return outcome


class PromiseBroken(AssertionError):
    """A broken promise; subclasses name the cause (see :func:`broken`)."""


_CAUSES: dict[str, type[PromiseBroken]] = {}


def broken(cause: str, message: str) -> PromiseBroken:
    """An AssertionError whose class names ``cause``.

    Hypothesis tells failures apart by exception type and where it was raised: one class per
    cause (a crash site, a wrong exit code...) makes it report, and shrink, each separately
    rather than only the first one found.
    """
    if cause not in _CAUSES:
        name = "Broken_" + re.sub(r"\W+", "_", cause).strip("_")[:80]
        _CAUSES[cause] = type(name, (PromiseBroken,), {})
    return _CAUSES[cause](f"[{cause}]\n{message}")


def crash_site(outcome: Outcome) -> str | None:
    """``ErrorType at file.py:line`` of the innermost maskln_cli frame, for a crash."""
    error = outcome.exception
    if error is not None and not isinstance(error, SystemExit):
        frames = [
            f for f in traceback.extract_tb(error.__traceback__) if "maskln_cli" in f.filename
        ]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        return f"{type(error).__name__} at {where}"
    if "maskln: error: internal error:" in outcome.stderr:  # the CLI's backstop for a bug
        return outcome.stderr.split("internal error: ", 1)[1].split(" (please", 1)[0]
    if "Traceback" in outcome.stderr:
        sites = re.findall(r'maskln_cli/(\w+\.py)", line (\d+)', outcome.stderr)
        last = outcome.stderr.strip().splitlines()[-1].split(":")[0]
        return f"{last} at {':'.join(sites[-1]) if sites else '?'}"
    return None


def check_outcome(outcome: Outcome, allowed: set[int]) -> None:
    """The promise: an allowed exit code; on 2, exactly one clean error line; never a crash."""
    site = crash_site(outcome)
    if site is not None:
        raise broken(f"crash: {site}", outcome.describe())
    if outcome.exit_code not in allowed:
        raise broken(f"exit code {outcome.exit_code}", outcome.describe())
    # Nothing in the fuzz inputs is big: running out of memory means an unbounded allocation.
    if "out of memory" in outcome.stderr:
        raise broken("out of memory", outcome.describe())
    if outcome.exit_code == 2:
        lines = outcome.stderr.strip("\n").splitlines()
        if len(lines) != 1 or not lines[0].startswith("maskln: error: "):
            raise broken("exit 2 without exactly one 'maskln: error: ' line", outcome.describe())
        # A warning would print file:line and source lines to stderr in a real process.
        if outcome.warnings:
            raise broken("Python warning on an error path", outcome.describe())


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def hidden_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- checking a normalize result ----------------------------------------------------------------


def read_file(
    path: Path, keys: tuple[str, ...] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (all, or those of ``keys`` present) and metadata, as safetensors reads them."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        names = [k for k in handle.offset_keys() if keys is None or k in keys]
        return {k: handle.get_tensor(k) for k in names}, handle.metadata() or {}


def read_output(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An output maskln reported as written: it must be a valid safetensors file."""
    try:
        return read_file(path)
    except Exception as error:
        head = path.read_bytes()[:300]
        raise AssertionError(
            f"exit 0, but the output is not a valid safetensors file: {error}\n{head!r}"
        ) from None


def _moderate(t: torch.Tensor, bound: float) -> torch.Tensor:
    t = t.double()
    return t.isfinite() & (t.abs() < bound)


def check_normalize_output(
    input_path: Path, output_path: Path, eps: str | float | None = None, dtype: str = "auto"
) -> None:
    """OUTPUT (valid safetensors) holds the right keys and shapes, exact zeros at invalid rows,
    finite values at valid rows whose inputs are moderate, close to the float64 reference.

    ``eps`` and ``dtype`` are the --eps and --dtype options given, if any.
    """
    from maskln_cli.op.reference import reference_masked_layer_norm

    inputs, in_meta = read_file(input_path, ("x", "valid", "scale", "bias", "grad_out"))
    outputs, out_meta = read_output(output_path)
    x = inputs["x"]
    channels = x.shape[-1]
    leading = x.shape[:-1]
    if "valid" in inputs:
        valid = inputs["valid"]
        valid = valid.view(torch.uint8) != 0 if valid.dtype == torch.bool else valid == 1
    else:
        valid = torch.ones(leading, dtype=torch.bool)
    scale = inputs.get("scale", torch.ones(channels)).double()
    bias = inputs.get("bias", torch.zeros(channels)).double()
    eps_text = eps if eps is not None else in_meta.get("eps", "1e-05")
    eps = float(eps_text)
    expected_keys = {"out"} | (
        {"grad_x", "grad_scale", "grad_bias"} if "grad_out" in inputs else set()
    )
    assert set(outputs) == expected_keys, (sorted(outputs), sorted(expected_keys))
    out = outputs["out"]
    assert out.shape == x.shape, (out.shape, x.shape)
    out_dtype = x.dtype if dtype == "auto" else getattr(torch, dtype)
    assert out.dtype == out_dtype, (out.dtype, out_dtype)
    assert float(out_meta["eps"]) == eps, (out_meta, eps)

    rows_out = out.double().reshape(-1, channels)
    rows_valid = valid.reshape(-1)
    invalid_rows = rows_out[~rows_valid]
    assert bool((invalid_rows == 0).all()), "out is not exactly 0 at invalid rows"
    assert not bool(invalid_rows.signbit().any()), "out is -0.0 at invalid rows"
    if "grad_x" in outputs:
        grad_rows = outputs["grad_x"].double().reshape(-1, channels)[~rows_valid]
        assert bool((grad_rows == 0).all()), "grad_x is not exactly 0 at invalid rows"

    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    big = math.sqrt(torch.finfo(compute).max) / (4 * channels)
    out_max = torch.finfo(out.dtype).max
    param_bound = out_max / (4 * (math.sqrt(channels) + 1))
    rows_x = x.double().reshape(-1, channels)
    row_ok = _moderate(rows_x, big).all(dim=1) & rows_valid
    params_ok = bool(_moderate(scale, param_bound).all() and _moderate(bias, param_bound).all())
    if not params_ok or rows_x.shape[0] == 0:
        return
    finite = rows_out.isfinite().all(dim=1)
    bad = row_ok & ~finite
    assert not bool(bad.any()), (
        f"out is not finite at valid rows {bad.nonzero().flatten().tolist()[:5]} with finite,"
        f" moderate inputs (eps {eps!r}, x rows {rows_x[bad][:2].tolist()},"
        f" out {rows_out[bad][:2].tolist()})"
    )
    # Against the float64 reference, on well-conditioned rows.
    reference = reference_masked_layer_norm(rows_x, rows_valid, scale, bias, eps)
    spread = (rows_x - rows_x.mean(dim=1, keepdim=True)).square().mean(dim=1) + eps
    conditioned = row_ok & (spread > (1e-3 * rows_x.abs().amax(dim=1)).square())
    tolerance = {torch.float64: 1e-9, torch.float32: 1e-4}.get(out.dtype, 3e-2)
    atol = tolerance * (
        1 + float(scale.abs().max()) * math.sqrt(channels) + float(bias.abs().max())
    )
    error = (rows_out - reference).abs().amax(dim=1)
    wrong = conditioned & ~(error <= atol + tolerance * reference.abs().amax(dim=1))
    assert not bool(wrong.any()), (
        f"out differs from the float64 reference at rows {wrong.nonzero().flatten().tolist()[:5]}:"
        f" max error {float(error[wrong].max())}"
    )


# --- values and text the reports must carry exactly (issue 13) ---------------------------------

INTEGER_RANGES = {
    torch.int64: (-(2**63), 2**63 - 1),
    torch.uint64: (0, 2**64 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
    torch.bool: (0, 1),
}


def integer_tensor(values: list[int], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` (uint64 through int64 bits: torch makes none from
    ints of 2**63 and up)."""
    if dtype == torch.uint64:
        bits = [v - 2**64 if v >= 2**63 else v for v in values]
        return torch.tensor(bits, dtype=torch.int64).view(torch.uint64).reshape(shape)
    return torch.tensor(values, dtype=torch.int64).to(dtype).reshape(shape)


@dataclasses.dataclass
class IntegerPair:
    """Two integer tensors of one dtype and shape, equal but at ``changed`` (flat indices),
    where they are one unit apart."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    actual: list[int]
    expected: list[int]
    changed: list[int]


@st.composite
def integers_one_unit_apart(draw) -> IntegerPair:
    """int64, uint64, int32 or bool values, mostly at magnitudes float64 cannot tell apart
    (beyond 2**53, near the dtype's limits), and the same values one unit off at some places:
    each is a mismatch with a difference of exactly 1."""
    dtype = draw(st.sampled_from(list(INTEGER_RANGES)), label="dtype")
    shape = draw(st.sampled_from([(1,), (5,), (2, 3), (3, 1, 4)]), label="shape")
    low, high = INTEGER_RANGES[dtype]
    near = [st.integers(low, min(high, low + 2**10)), st.integers(max(low, high - 2**10), high)]
    if high > 2**53:  # where float64 has no odd integers
        near.append(st.integers(2**53 - 4, 2**53 + 4))
    if low < -(2**53):
        near.append(st.integers(-(2**53) - 4, -(2**53) + 4))
    values = draw(
        st.lists(st.one_of(*near, st.integers(low, high)), min_size=math.prod(shape),
                 max_size=math.prod(shape)),
        label="values",
    )  # fmt: skip
    changed = sorted(
        draw(st.sets(st.integers(0, len(values) - 1), min_size=1, max_size=len(values)))
    )
    expected = list(values)
    for index in changed:
        expected[index] += 1 if values[index] < high else -1
    return IntegerPair(dtype, shape, values, expected, changed)


EMOJI_CODES = [":warning:", ":thumbs_up:", ":x:", ":up:", ":smile:", ":cross_mark:", ":+1:"]
JSON_PIECES = ["[", "]", "{", "}", ",", ", ", ":", " ", "   ", '"', "\\", "\\n", "null", "true",
               "-2.5e3", "1", "[bold]", "[/]", "[red]x[/red]", "\\[", "\t", "\n"]  # fmt: skip


@st.composite
def json_looking_text(draw, min_size: int = 0, max_size: int = 40) -> str:
    """Text a report must carry as it is: number lists with odd spacing (``[ 3,   4 ]``),
    JSON punctuation, quotes and backslashes, rich markup, ``:emoji:`` codes, any Unicode."""
    number = st.integers(-99, 999) | st.floats(allow_nan=False, allow_infinity=False, width=32)
    number_list = st.builds(
        lambda numbers, separator, inside: f"[{inside}{separator.join(map(str, numbers))}{inside}]",
        st.lists(number, max_size=4),
        st.sampled_from([",", ", ", " ,  ", ",\n", ",\t"]),
        st.sampled_from(["", " ", "  "]),
    )
    characters = st.characters(exclude_categories=("Cs",))  # UTF-8 has no lone surrogates
    piece = st.one_of(
        st.sampled_from(EMOJI_CODES + JSON_PIECES), number_list, st.text(characters, max_size=4)
    )
    text = "".join(draw(st.lists(piece, min_size=1, max_size=6)))[:max_size]
    return text if len(text) >= min_size else text + "k" * (min_size - len(text))


# Commands naming a file, where {s} is the special file; {i} an input, {r} a result, {o} an
# output (regular files).
FILE_ARGUMENTS = [
    ("inspect", "{s}"),
    ("inspect", "--keys", "{s}"),
    ("inspect", "--json", "{s}"),
    ("normalize", "{s}", "{o}"),
    ("normalize", "{i}", "{o}", "--params", "{s}"),
    ("normalize", "{i}", "{o}", "--grad-out", "{s}"),
    ("normalize", "{i}", "{o}", "--config", "{s}"),
    ("verify", "{s}", "{r}"),
    ("verify", "{i}", "{s}"),
    ("verify", "{i}", "{r}", "--params", "{s}"),
    ("verify", "{i}", "{r}", "--config", "{s}"),
    ("verify", "{i}", "{r}", "--valid", "{s}"),
    ("diff", "{s}", "{i}"),
    ("diff", "{i}", "{s}", "--json"),
    ("diff", "{i}", "{i}", "--valid", "{s}"),
]
SPECIAL_KINDS = {"fifo": "FIFO", "socket": "socket", "device": "character device"}
"""Each kind of file that is no regular file, and the word the error line uses for it."""
SPECIAL_NAMES = ["p", "in.safetensors", "run:up:1.safetensors", "[bold]x", "é ∑ 💥", "a b"]


@contextlib.contextmanager
def special_file(kind: str, folder: Path, name: str) -> Iterator[Path]:
    """``folder/name`` as a FIFO, a listening UNIX socket, or a symlink to /dev/zero.

    The FIFO has a writer attached that has written 8 bytes no safetensors parser accepts (a
    header of 2**64 - 1 bytes), and the socket listens: should maskln ever open them, it fails
    at once, with some other message, instead of blocking the test.
    """
    path = folder / name
    if kind == "fifo":
        os.mkfifo(path)
        writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # opens without a reader
        os.write(writer, b"\xff" * 8)
        try:
            yield path
        finally:
            os.close(writer)
    elif kind == "socket":
        import socket

        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            server.listen()
            yield path
    else:
        path.symlink_to("/dev/zero")
        yield path
