"""The package version: the one place it is written. vlseq_ext.__version__ imports it, and
pyproject.toml reads it at build time (setuptools `attr:`, parsed without importing vlseq_ext, so
building never imports torch or the extension)."""
__version__ = "0.2.0"
