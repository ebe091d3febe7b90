"""Layer 5, tools: the command line, the demo, and a local multi-process world. Public names only."""
