"""What a systemd unit runs, read from the unit file as systemd reads it, not retyped.

Only what decides the command and its environment is read: ``ExecStart`` (its ``-@:+!``
prefixes dropped, backslash continuations joined, ``$VAR``/``${VAR}`` expanded from the unit's
environment), ``Environment`` and ``EnvironmentFile`` (``-`` = optional), in file order. The rest
(``Type``, ``User``, hardening, ...) is systemd's business and may change freely.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Unit:
    exec_start: tuple[str, ...]
    env: dict[str, str]


def service_lines(text: str) -> list[tuple[str, str]]:
    """``(key, value)`` of the ``[Service]`` section, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    section, out = None, []
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line:
            key, value = line.split("=", 1)
            out.append((key.strip(), value.strip()))
    return out


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (quotes removed), as systemd's EnvironmentFile= reads them."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and line[0] not in "#;" and "=" in line:
            key, value = line.split("=", 1)
            env[key.strip()] = " ".join(shlex.split(value)) if value.strip() else ""
    return env


def read_unit(path: Path, paths: dict[str, str]) -> Unit:
    """The unit's ExecStart and environment; ``paths`` maps the unit's file paths (its venv's
    executable, /etc/mooncake/...) to where they are here."""
    env: dict[str, str] = {}
    exec_start: list[str] | None = None
    for key, value in service_lines(path.read_text()):
        if key == "Environment":
            env.update(item.split("=", 1) for item in shlex.split(value) if "=" in item)
        elif key == "EnvironmentFile":
            optional, name = value.startswith("-"), value.lstrip("-")
            local = Path(paths.get(name, name))
            if local.is_file() or not optional:
                env.update(read_env_file(local))
        elif key == "ExecStart" and value:
            exec_start = shlex.split(value.lstrip("-@:+!"))
    if not exec_start:
        raise ValueError(f"{path}: no ExecStart")
    expanded = [_VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), word) for word in exec_start]
    return Unit(tuple(_local(word, paths) for word in expanded), env)


def _local(word: str, paths: dict[str, str]) -> str:
    """A path word, or the path of a ``--flag=PATH`` word, where it is here."""
    flag, eq, value = word.partition("=")
    if eq and flag.startswith("-") and value in paths:
        return f"{flag}={paths[value]}"
    return paths.get(word, word)
