"""Layer 4, what users call: `gather`, and the `Collector` with its roles (senders, rank dst, block writers).

Combines `tdgather.comm` (moving frames) with `tdgather.storage` (writing them).
"""
