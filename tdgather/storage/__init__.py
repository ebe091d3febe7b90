"""Layer 3a, storage.

The output directory's rules, atomic writes, the sink that writes a dataset, recovery from the
shards' own records, and the reader. Uses `tdgather.format` and `tdgather.core`; never `tdgather.comm`.
"""
