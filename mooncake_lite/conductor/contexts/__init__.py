"""Cached contexts (``/v1/contexts``): their endpoints, their book, the prefill-only job and store
holds that make one, and the sink that takes its KV stream."""
