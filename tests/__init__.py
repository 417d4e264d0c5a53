"""The test suite: a package, so that test modules import their helpers as `tests.<...>` (no path patches)."""
