"""Finding a key among hundreds: the closest names to one that is missing.

A checkpoint holds hundreds of keys, and the one a user types is often nearly right: another
case (``layernorm`` for ``LayerNorm``), or the other naming of a layer norm's parameters (ESM
saves ``.gamma``/``.beta`` where the module has ``.weight``/``.bias``). Standard library only,
so the low modules (tensorfile) can use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

SUFFIX_SWAPS = {".weight": ".gamma", ".gamma": ".weight", ".bias": ".beta", ".beta": ".bias"}
"""A layer norm's parameters under their two usual names: PyTorch's and the older TF/ESM ones."""
SUGGESTIONS = 5
"""How many close names a message offers."""
LIST_ALL_UP_TO = 8
"""A file with at most this many keys has them all listed when one is missing."""


def swapped(key: str) -> str | None:
    """``key`` with its weight/gamma or bias/beta suffix swapped, or None.

    Example:
        >>> swapped("encoder.layer.0.LayerNorm.gamma"), swapped("x")
        ('encoder.layer.0.LayerNorm.weight', None)
    """
    for suffix, other in SUFFIX_SWAPS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)] + other
    return None


def closest_keys(wanted: str, keys: Sequence[str], limit: int = SUGGESTIONS) -> list[str]:
    """Up to ``limit`` names in ``keys`` closest to ``wanted``, best first.

    First the same name in another case, then with weight<->gamma or bias<->beta swapped
    (any case), then difflib's closest on lowercased names.

    Example:
        >>> keys = ["encoder.layer.0.LayerNorm.gamma", "encoder.layer.0.LayerNorm.beta",
        ...         "encoder.layer.1.LayerNorm.gamma", "embeddings.word_embeddings.weight"]
        >>> closest_keys("encoder.layer.0.layernorm.weight", keys, limit=2)
        ['encoder.layer.0.LayerNorm.gamma', 'encoder.layer.1.LayerNorm.gamma']
    """
    by_lower: dict[str, list[str]] = {}
    for key in keys:
        by_lower.setdefault(key.lower(), []).append(key)
    found: list[str] = []

    def add(names: Sequence[str]) -> None:
        found.extend(name for name in names if name not in found and name != wanted)

    lowered = wanted.lower()
    variants = [lowered] + [v for v in [swapped(lowered)] if v is not None]
    for variant in variants:
        add(by_lower.get(variant, []))
    # Score each close name by its best match with either spelling, so that a 'weight'
    # asked for ranks the other layers' 'gamma' above this layer's 'beta'.
    scores: dict[str, float] = {}
    for variant in variants:
        for match in difflib.get_close_matches(variant, list(by_lower), n=2 * limit, cutoff=0.6):
            ratio = difflib.SequenceMatcher(None, variant, match).ratio()
            scores[match] = max(scores.get(match, 0.0), ratio)
    for match in sorted(scores, key=lambda name: -scores[name]):
        add(by_lower[match])
    return found[:limit]


def missing_key_message(source: str, key: str, keys: Sequence[str], what: str = "tensor") -> str:
    """``source: no tensor 'key' (...)``, naming the closest keys, or every key of a small file.

    Example:
        >>> missing_key_message("in.safetensors", "vaild", ["x", "valid"])
        "in.safetensors: no tensor 'vaild' (it holds 'valid', 'x')"
    """
    close = closest_keys(key, keys)
    if len(keys) <= LIST_ALL_UP_TO:
        held = close + [k for k in keys if k not in close]
        shown = ", ".join(repr(k) for k in held) or "nothing"
        return f"{source}: no {what} {key!r} (it holds {shown})"
    listing = f"maskln inspect --keys {source} lists all {len(keys):,}"
    if not close:
        return f"{source}: no {what} {key!r}, nor any close name ({listing})"
    shown = ", ".join(repr(k) for k in close)
    return f"{source}: no {what} {key!r}; closest: {shown} ({listing})"
