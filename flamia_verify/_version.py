"""The package's version, in a module of its own so that any layer of the package may read it without
importing the package's top-level facade (which reaches the API)."""

__version__ = "0.1.0"
