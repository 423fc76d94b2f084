"""The context holds' journal: ``<ssd-dir>/pins.json``, rewritten whole and atomically at each
change (a few entries), so blocks held for a cached context stay held across a restart."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PIN_JOURNAL = "pins.json"


class PinJournal:
    """The store's context holds as one small JSON file: ``{"version": 1, "pins": {owner:
    {"expires_at": unix seconds, "keys": [hex, ...]}}}``, replaced atomically on each save."""

    VERSION = 1

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync

    def save(self, entries: dict[str, tuple[frozenset[bytes], float]]) -> None:
        pins = {owner: {"expires_at": expires_at, "keys": sorted(k.hex() for k in keys)}
                for owner, (keys, expires_at) in entries.items()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as fh:
                json.dump({"version": self.VERSION, "pins": pins}, fh)
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:   # the holds still apply in memory; only a restart would lose them
            log.error("could not write the pin journal %s: %s", self.path, exc)

    def load(self) -> dict[str, tuple[list[bytes], float]]:
        """owner -> (keys, expires_at); an absent file is empty, a bad one is logged and ignored."""
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("pin journal %s unreadable (%s); no holds restored", self.path, exc)
            return {}
        try:
            doc = json.loads(raw)
            if doc.get("version") != self.VERSION:
                raise ValueError(f"version {doc.get('version')!r}")
            return {str(owner): ([bytes.fromhex(k) for k in entry["keys"]], float(entry["expires_at"]))
                    for owner, entry in doc["pins"].items()}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("pin journal %s is invalid (%s); no holds restored", self.path, exc)
            return {}
