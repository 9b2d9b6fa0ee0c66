"""The package version, in a module that imports nothing: ``dtypeaudit --version`` and the report writers read it."""

__version__ = "0.1.0"
