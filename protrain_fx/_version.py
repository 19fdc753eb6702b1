"""The package version (pyproject.toml says the same): part of every plan cache key."""

__version__ = "0.1.0"
