"""The package's version, in a module of its own so that any layer may read it without
importing the ``remat`` facade (which lazily reaches the layers above them all)."""

__version__ = "0.1.0"
