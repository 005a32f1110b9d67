"""The package's version: one place, read by the packaging metadata (pyproject.toml) and by every module that
records it, so that none of them imports the package root."""

__version__ = "0.1.0"
