"""pytest's collection: modules that need an optional extra are skipped when it is not installed.

``--doctest-modules`` imports every module; one that imports ``lightning`` would fail to import on a
machine without the ``lightning`` extra, instead of being skipped as its tests are.
"""

collect_ignore = []
try:
    import lightning  # noqa: F401
except ModuleNotFoundError:
    collect_ignore += ["tdgather/integrations/lightning.py", "tests/lightning_cases.py"]
