"""The package version, in one place: ``tierckpt.__version__`` and the build
(pyproject.toml, ``[tool.setuptools.dynamic]``) both read it. A plain literal, so setuptools
reads it statically, without importing the package."""

__version__ = "0.1.0"
"""This release's version (PEP 440); also the ``tierckpt`` version a manifest records."""
