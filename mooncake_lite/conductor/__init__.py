"""The conductor role: OpenAI-compatible API, cluster membership, and dispatch of each request
to the prefill and decode instances the pure scheduler (``mooncake_lite.scheduler``) picks.
See docs/conductor.md."""
