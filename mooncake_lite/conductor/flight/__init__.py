"""One request in flight: its placement, its calls to the prefill and decode instances (with
retries elsewhere), the events they send back, and the conductor's drain of the requests in flight."""
