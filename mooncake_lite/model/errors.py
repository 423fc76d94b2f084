"""What every checkpoint reader raises (config.json, safetensors, GGUF), defined below all of them."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint directory is unusable: missing or mismatched tensors, unsupported features."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is absent (caught by ``except ValueError`` and ``except OSError``)."""
