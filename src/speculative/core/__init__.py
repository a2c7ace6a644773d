"""The bottom layer: limits, sampling, verification, token trees, request rows, counters and
input checks. Pure functions and small records; it imports nothing else of `speculative`."""
