"""``mooncake bench replay``: an OpenAI load generator that replays a Mooncake trace.

``cli.py`` (flags, rendering) → ``run.py`` (one replay, measured) → ``workload.py`` (prompts
from trace hash ids, pure) and ``sender.py`` (open-loop sending at trace times) → ``client.py``
(one SSE stream, server metadata) → ``metrics.py`` (vLLM-style figures, pure); ``report.py``
writes ``result.json``, ``cdf.png`` and the text table.
"""
