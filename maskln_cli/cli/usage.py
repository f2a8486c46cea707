"""How the commands look to Typer's user: help that shows metavars as written (``INPUT``,
``FILE``, ``KEY``), and a usage error (a bad option value, a missing argument) as one line on
stderr, like every other error."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from maskln_cli.cli.failures import EXIT_ERROR


class _PlainArgument(TyperArgument):
    """An argument shown by its metavar alone: ``INPUT``, not ``{INPUT}`` and ``<str>``."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return name if self.required else f"[{name}]"


class _PlainOption(TyperOption):
    """An option shown by its metavar (``FILE``, ``KEY``), a flag by its name alone: typer
    would add ``<bool>``, ``<str>``, ``<int range> [x>=1]`` and split long choice lists."""

    def display_type_rich(self, ctx: Any) -> str | None:
        if self.is_flag or self.count:
            return None
        return self.metavar or str(getattr(getattr(self, "type", None), "name", "value")).upper()

    def _get_number_range_help_str(self) -> str | None:
        return None  # each help text says its range in words


def _plain(params: list[Any]) -> list[Any]:
    for param in params:
        if type(param) is TyperArgument:
            param.__class__ = _PlainArgument
        elif type(param) is TyperOption:
            param.__class__ = _PlainOption
    return params


class PlainHelp(TyperCommand):
    """A command whose help shows metavars as written (see :class:`_PlainOption`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))


class OneLineErrors(TyperGroup):
    """Usage errors (a bad option value, a missing argument) as one line, like every error."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as failure:
            format_message = getattr(failure, "format_message", None)
            if format_message is None:
                raise
            # NoArgsIsHelpError has printed the help already; it needs no message.
            if type(failure).__name__ != "NoArgsIsHelpError":
                from maskln_cli.cli.report import messages

                context = getattr(failure, "ctx", None)
                hint = f" (see '{context.command_path} --help')" if context else ""
                message = format_message().replace("Value error, ", "").rstrip(".")
                messages.error(f"{message}{hint}")
            sys.exit(getattr(failure, "exit_code", EXIT_ERROR))
        except typer.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)
