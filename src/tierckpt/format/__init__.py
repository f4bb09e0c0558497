"""The on-disk format: names, the manifest value, checksums. Pure and torch-free."""
