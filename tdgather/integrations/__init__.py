"""Layer 5, other libraries' hooks (Lightning). They use only tdgather's public names."""
