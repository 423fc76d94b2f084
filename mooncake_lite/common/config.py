"""One frozen dataclass per role, filled from defaults < TOML file < MOONCAKE_* env < CLI flags.

A config class declares its fields with :func:`option`; :func:`load_config` builds the argparse
parser from those fields (so ``--help`` documents every flag), reads the optional ``--config``
TOML file (section named after the role, plus a shared ``[cluster]`` section), reads
``MOONCAKE_<FIELD>`` environment variables, and constructs the dataclass, whose
``__post_init__`` validates. Any bad value becomes a :class:`ConfigError` with a clear message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""


class ListenError(Exception):
    """A role's port cannot be bound (another process holds it): the CLI's one line and exit 2."""

    @classmethod
    def of(cls, exc: OSError, host: str, port: int, flag: str) -> ListenError:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        return cls(f"cannot listen on {host}:{port}: {reason} (--host, {flag})")


def option(default: Any, help: str, *, parse: Callable[[Any], Any] | None = None,
           choices: Sequence[str] | None = None, flag: str | None = None, aliases: Sequence[str] = ()) -> Any:
    """Declare a config field: its default, its ``--help`` text, and optionally a parser
    for string values (``parse_size``), allowed choices, a flag name override, or other
    spellings of the flag (``--tp`` for ``--tensor-parallel``)."""
    meta = {"help": help, "parse": parse, "choices": tuple(choices) if choices else None, "flag": flag,
            "aliases": tuple(aliases)}
    return dataclasses.field(default=default, metadata=meta)


def require(condition: bool, message: str) -> None:
    """Validation helper for ``__post_init__``: raise ConfigError(message) unless condition."""
    if not condition:
        raise ConfigError(message)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field) -> str:
    return "MOONCAKE_" + f.name.upper()


def _base_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of an annotation like ``int``, ``str | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _convert(f: dataclasses.Field, hint: Any, raw: Any, source: str) -> Any:
    base, optional = _base_type(hint)
    parse = f.metadata.get("parse")
    try:
        if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("", "none")):
            if not optional:
                raise ValueError("a value is required")
            return None
        if parse is not None:
            value = parse(raw)
        elif base is bool:
            value = _parse_bool(raw)
        elif base in (int, float, str):
            if base is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError("expected an integer")
            value = base(raw)
        else:
            value = raw
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{flag_name(f)} (from {source}): {exc}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{flag_name(f)} (from {source}): {value!r} is not one of {', '.join(choices)}")
    return value


def _parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def add_arguments(cls: type, parser: argparse.ArgumentParser) -> None:
    """Add one flag per dataclass field; defaults are suppressed so we can tell what was given."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        base, _ = _base_type(hints[f.name])
        help_text = f"{f.metadata.get('help', '')} [default: {f.default!r}; env {env_name(f)}]"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = f.name.upper()
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag_name(f), *f.metadata.get("aliases", ()), **kwargs)


def read_toml(path: str, sections: Sequence[str]) -> dict[str, Any]:
    """Merge the named sections of a TOML file (later sections win). Keys may use - or _."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {path} is not valid TOML: {exc}") from None
    merged: dict[str, Any] = {}
    for name in sections:
        section = data.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"--config: [{name}] in {path} must be a table")
        merged.update({k.replace("-", "_"): v for k, v in section.items()})
    return merged


def build_config(cls: type[C], *, cli: Mapping[str, Any] | None = None, toml: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> C:
    """Construct ``cls`` from the three sources with precedence cli > env > toml > default."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(toml or {}) - known)
    if unknown:
        raise ConfigError(f"--config: unknown key(s) for this role: {', '.join(unknown)}")
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if cli and f.name in cli:
            values[f.name] = _convert(f, hints[f.name], cli[f.name], "command line")
        elif env_name(f) in env:
            values[f.name] = _convert(f, hints[f.name], env[env_name(f)], env_name(f))
        elif toml and f.name in toml:
            values[f.name] = _convert(f, hints[f.name], toml[f.name], "config file")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def load_config(cls: type[C], argv: Sequence[str], *, prog: str, section: str, description: str = "",
                env: Mapping[str, str] | None = None) -> C:
    """Parse ``argv`` for a role: ``--config FILE`` plus one flag per field of ``cls``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML file; its [cluster] and [%s] sections are read" % section)
    add_arguments(cls, parser)
    ns = vars(parser.parse_args(list(argv)))
    config_path = ns.pop("config")
    toml = read_toml(config_path, ["cluster", section]) if config_path else {}
    if config_path:
        # [cluster] holds keys shared by all roles; keep only what this role knows.
        shared = read_toml(config_path, ["cluster"])
        known = {f.name for f in dataclasses.fields(cls)}
        toml = {k: v for k, v in toml.items() if k in known or k not in shared}
    return build_config(cls, cli=ns, toml=toml, env=env)
