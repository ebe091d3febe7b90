"""Layer 3a, storage.

Stores (bytes only: `store`, `objects`), how a run is committed (`output`, `local`, `prefix`), the
sink that writes a dataset (`writer`), what a run saved and resuming it (`runstate`, `saved`, `scan`,
`resume`), and the reader. Uses `tdgather.format` and `tdgather.core`; never `tdgather.comm`.
"""
