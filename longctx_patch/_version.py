"""The package's version: a leaf module (it imports nothing), so that the package root and the saved format
(checkpoint.py, which records the version that wrote a folder) both take it from here without importing each other."""

__version__ = "0.1.0"
