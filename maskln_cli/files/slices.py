"""``--shard K/N``: the K-th of N deterministic slices of a sorted list of files or targets.

One rule for every command that takes the option (``verify DUMPS/``, ``grade`` of a class), so
that the slices of a scheduler's array job concatenate into the whole report whichever command
ran them.
"""

from __future__ import annotations

from collections.abc import Sequence

from maskln_cli.errors import MasklnError

__all__ = ["parse_shard", "shard_of"]


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` as ``(K, N)``, 1 <= K <= N.

    Example:
        >>> parse_shard("3/8")
        (3, 8)
    """
    k, slash, n = text.partition("/")
    try:
        shard = (int(k), int(n)) if slash else None
    except ValueError:
        shard = None
    if shard is None or not 1 <= shard[0] <= shard[1]:
        raise MasklnError(
            f"--shard {text!r}: give K/N, the K-th of N slices, 1 <= K <= N (e.g. 3/8)"
        )
    return shard


def shard_of(names: Sequence[str], shard: tuple[int, int] | None) -> list[str]:
    """The K-th of N contiguous slices of ``names`` (as sorted): slices 1 to N, concatenated,
    are ``names``; their sizes differ by one at most.

    Example:
        >>> names = list("abcdefg")
        >>> [shard_of(names, (k, 3)) for k in (1, 2, 3)]
        [['a', 'b'], ['c', 'd'], ['e', 'f', 'g']]
    """
    if shard is None:
        return list(names)
    k, n = shard
    return list(names[len(names) * (k - 1) // n : len(names) * k // n])
