"""Layer 1, the data model and its policies.

Frames, layouts, ragged leaves, the frame store, placement, merging, duplicates, checks of JSON.

No file I/O and no process group here: everything above builds on these. Imports go down only
(`tdgather.errors` below); the order of the layers is checked in CI (``lint-imports``).
"""
