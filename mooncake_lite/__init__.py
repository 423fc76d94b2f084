"""mooncake-lite: a KVCache-centric disaggregated LLM serving system in Python."""

__version__ = "0.1.0"
