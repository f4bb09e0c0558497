"""CLI tests (a package so their module names do not clash with the library tests)."""
