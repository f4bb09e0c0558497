"""Tier 2 (object storage): backends, the catalogue, the uploader, fetch. Torch-free."""
