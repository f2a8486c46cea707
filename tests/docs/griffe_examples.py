"""A griffe extension for the API pages: maskln's docstrings head their doctests ``Example:``,
which griffe's Google-style parser does not know (it knows ``Examples:``); read as prose, their
``>>>`` lines would be run together and their brackets taken for links. Renamed here, they
render as code and the docstrings stay as they are."""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
