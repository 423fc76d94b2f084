"""The conductor role: the OpenAI-compatible API, cluster membership, and dispatch of each request
to the prefill and decode instances the pure scheduler (``mooncake_lite.scheduler``) picks.
See docs/conductor.md.

Its files, by what they serve: ``api/`` (the public API: routes, body limits, parsing, the answer
relayed as JSON or SSE, text, reasoning, errors), ``flight/`` (one request: placement, the flight
and its attempts' calls to the instances, their events, the drain), ``cluster/`` (what the
conductor knows of the cluster: the internal endpoints, stores heard from, hot-block replication,
metrics, status and cost exports), ``contexts/`` (cached contexts); ``app.py``, ``config.py``,
``main.py`` and ``services.py`` (what all of them share, one per app) at the top.
"""
