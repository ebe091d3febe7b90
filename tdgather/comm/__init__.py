"""Layer 3b, communication between processes.

The wire format, per-peer message streams, the protocol of one sender's stream, and packing a
store for the wire. Uses `tdgather.core`; never `tdgather.storage`. (Named ``comm``, not ``dist``:
tools skip folders named ``dist``, as build output.)
"""
