"""Text as shown: what came from a file made safe to print, and numbers in a compact form.

:func:`safe` makes rich markup that shows a text as it is (control characters escaped, markup
and backslashes neutralised); :func:`plain_safe` escapes control characters only, for a rich
``Text``, which reads no markup.
"""

from __future__ import annotations

import re
import unicodedata


def safe(text: object) -> str:
    r"""``text`` with control characters escaped (:func:`plain_safe`), as rich markup that
    shows it as it is, whatever markup comes before or after it.

    rich's own ``escape`` is not that: ``\[`` shows as ``[``, and a trailing backslash is
    doubled, or escapes a tag that follows. Here every ``[`` is written ``\[`` (a bracket,
    whatever follows it), and a run of backslashes before a bracket or at the end is doubled
    and closed by an empty ``[none][/none]`` (rich halves the backslashes before a tag).

    Example:
        >>> safe("key\x1b[2J[bold]")
        'key\\x1b\\[2J\\[bold]'
        >>> from rich.markup import render
        >>> [render(f"[bold]{safe(t)}[/]").plain for t in ("a\\[b]", "\\", "[x")]
        ['a\\[b]', '\\', '[x']
    """
    return _MARKUP_SPECIAL.sub(_escape_markup, plain_safe(text))


_MARKUP_SPECIAL = re.compile(r"(\\*)(\[|\Z)|(\\+)")


def _escape_markup(match: re.Match[str]) -> str:
    backslashes, bracket, other = match.groups()
    if other:  # backslashes before any other character are shown as they are
        return other
    closed = backslashes * 2 + "[none][/none]" if backslashes else ""
    return closed + ("\\[" if bracket else "")


def plain_safe(text: object) -> str:
    """``text`` with control characters escaped, for a rich ``Text`` (which reads no markup).

    Example:
        >>> plain_safe("key\\x1b[2J[bold]")
        'key\\\\x1b[2J[bold]'
    """
    text = str(text)
    if text.isascii() and text.isprintable():  # the usual key: nothing to escape
        return text
    return "".join(
        ch if unicodedata.category(ch) not in {"Cc", "Cf", "Cs", "Zl", "Zp"} else _escape_char(ch)
        for ch in text
    )


def _escape_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def number(value: float | int | None) -> str:
    """A compact number for tables: ints with separators, floats to 4 significant digits."""
    if value is None:
        return ""
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"
