"""Shared-secret checks for internal HTTP calls between roles.

Every internal HTTP request (register, heartbeat, block events, prefill/generate/abort) carries
the cluster token in the ``X-Mooncake-Cluster-Token`` header when ``--cluster-token`` is set.
The binary data sockets present the same token in their HELLO frame (``transfer/server.py``).
"""

from __future__ import annotations

import hmac

CLUSTER_TOKEN_HEADER = "X-Mooncake-Cluster-Token"


def token_matches(expected: str | None, given: str | None) -> bool:
    """True when no token is configured, or ``given`` equals it (constant-time compare)."""
    if expected is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def cluster_headers(token: str | None) -> dict[str, str]:
    """Headers to add to an outgoing internal request."""
    return {CLUSTER_TOKEN_HEADER: token} if token is not None else {}
