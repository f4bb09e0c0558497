"""Shared pytest fixtures."""

pytest_plugins = ["s3server"]
