"""Glue between the supervisor and the live roles: addresses, flag support, registration wait."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import time

import aiohttp

from mooncake_lite.cluster.health import missing_instances
from mooncake_lite.cluster.plan import UpOptions
from mooncake_lite.common.launch import LAUNCHER, RoleFailed

ROLE_MODULES = {r: f"mooncake_lite.{r}.config" for r in ("conductor", "store", "prefill", "decode")}
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "[::1]"}


def connectable(hostport: str) -> str:
    """A ready line's bind address as something a local client can dial (0.0.0.0 → 127.0.0.1)."""
    host, _, port = hostport.rpartition(":")
    return f"{_WILDCARDS.get(host, host)}:{port}"


def role_fields(role: str) -> set[str]:
    """The config field names of a role."""
    mod = importlib.import_module(ROLE_MODULES[role])
    return {f.name for f in dataclasses.fields(mod.Config)}


def uses_builtin_launcher(opts: UpOptions) -> bool:
    return tuple(opts.launcher) == LAUNCHER


def with_role_support(opts: UpOptions) -> UpOptions:
    """``opts`` with each role's option names filled in, after refusing to start when a role
    would ignore a security option we were given.

    A silently ignored ``--api-key`` would leave the API open while the operator believes it is
    closed, so that is an error, not a warning. Nothing is checked for a custom ``--launcher``.
    """
    if not uses_builtin_launcher(opts):
        return opts
    known: dict[str, frozenset[str]] = {}
    for role in ROLE_MODULES:
        fields = role_fields(role)
        if opts.cluster_token and "cluster_token" not in fields:
            raise ValueError(f"--role {role} has no --cluster-token option")
        known[role] = frozenset(fields)
    if opts.api_key and "api_key" not in known["conductor"]:
        raise ValueError("the conductor has no --api-key option in this version")
    return dataclasses.replace(opts, role_fields=known)


async def wait_registered(conductor_url: str, want: dict[str, int], sup, *, timeout: float,
                          headers: dict[str, str] | None = None, interval: float = 0.2) -> dict:
    """Poll the conductor's ``/health`` until ``want`` instances per role are registered.

    Raises :class:`RoleFailed` when a child exits meanwhile or the deadline passes.
    """
    deadline = time.monotonic() + timeout
    body: object = None
    missing: dict[str, int] = dict(want)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            dead = sup.dead()
            if dead:
                raise sup.failure_of(dead[0])
            try:
                async with session.get(f"{conductor_url}/health") as resp:
                    body = await resp.json(content_type=None)
                missing = missing_instances(body, want)
                if not missing:
                    return body
            except (aiohttp.ClientError, ValueError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                conductor = sup.children.get("conductor")
                raise RoleFailed("conductor", f"still missing registrations {missing} after {timeout:g}s; "
                                  f"last /health: {str(body)[:300]}", conductor.tail if conductor else [])
            await asyncio.sleep(interval)
