"""Layer 2, the on-disk format.

File and tensor names, versions, the records of an index and a shard, and the one validator of
what is read from disk. No file is written here. Uses `tdgather.core` only.
"""
