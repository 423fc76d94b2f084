"""Pieces every role shares: config loading, block hashing, logging, service plumbing."""
