"""A benchmark's flags, parsed once into a frozen value its runners read and never change.

Each command lists its flags as a table (:func:`flag` rows, the ``add_argument`` arguments); the
parser is built from it, and :func:`freeze` turns the parsed namespace, plus the values the command
derives from it (a list split from a comma string, a device, per-model lengths), into one frozen
dataclass instance. A runner that needs another value makes a new one with ``dataclasses.replace``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

Flag = tuple[tuple[str, ...], dict[str, Any]]
Options = Any   # a command's frozen options, as :func:`freeze` made them (its fields are its flags)


def flag(*names: str, **kwargs: Any) -> Flag:
    """One row of a flag table: ``flag("--model", default=..., help=...)`` as ``add_argument``."""
    return names, kwargs


def build_parser(prog: str, description: str | None, flags: Sequence[Flag], **kwargs: Any) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the table's flags, in its order (the order ``--help`` lists)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, **kwargs)
    add_flags(parser, flags)
    return parser


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Sequence[Flag]) -> None:
    """The table's flags on ``parser`` or on one of its argument groups."""
    for names, options in flags:
        parser.add_argument(*names, **options)


def freeze(ns: argparse.Namespace, name: str, **derived: Any) -> Any:
    """The namespace's values, with ``derived`` ones put over them, as a frozen ``name`` dataclass."""
    values = {**vars(ns), **derived}
    cls = dataclasses.make_dataclass(name, [(key, Any) for key in values], frozen=True)
    return cls(**values)
