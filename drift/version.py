"""drift's version (a leaf module: reports stamp it, the package re-exports it)."""

__version__ = "0.2.0"
