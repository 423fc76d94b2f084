"""Mooncake request traces: the JSONL format, statistics and synthetic workloads."""

from mooncake_lite.trace.format import TraceError, TraceRequest, read_trace, scale_time, write_trace

__all__ = ["TraceError", "TraceRequest", "read_trace", "scale_time", "write_trace"]
