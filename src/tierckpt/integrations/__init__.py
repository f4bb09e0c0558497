"""Adapters for training frameworks; each submodule is imported only on demand."""
