"""The public OpenAI-compatible API: its routes, the request body's parsing and limits, the
answer's text (stop strings, the reasoning split) and the OpenAI-shaped errors."""
