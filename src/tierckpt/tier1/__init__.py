"""Tier 1: the only code that reads or changes the layout of a tier-1 root. Torch-free."""
