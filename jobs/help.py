"""`--help` as a user reads it: every default shown, and enum values as they are typed (`float32`, not
`DType.FLOAT32`). Parsers pass `formatter_class=HelpFormatter`; nothing here imports beyond argparse."""

from __future__ import annotations

import argparse
import copy
from enum import Enum
from typing import Any


def typed(value: Any) -> str:
    """A value the way a user would type it on the command line."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return " ".join(typed(v) for v in value)
    return str(value)


def has_default(action: argparse.Action) -> bool:
    """Whether `--help` should show the option's default: a value a user would otherwise have to guess."""
    default = action.default
    return bool(action.option_strings) and not (default is None or default is argparse.SUPPRESS
                                                or isinstance(default, bool) or default == [])


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written; appends `(default: …)` to every option that has a meaningful default."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and has_default(action):  # argparse skips the help string of options without one
            action = copy.copy(action)
            action.help = f"default: {typed(action.default)}".replace("%", "%%")
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "%(default)" in help_ or "default:" in help_ or not has_default(action):
            return help_
        return f"{help_} (default: {typed(action.default).replace('%', '%%')})"

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str):
        if action.metavar is None and action.choices is not None:
            choices = "{" + ",".join(typed(choice) for choice in action.choices) + "}"
            return lambda size: (choices,) * size
        return super()._metavar_formatter(action, default_metavar)
