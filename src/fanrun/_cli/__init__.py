"""The command line: one module per command."""

from .main import main

__all__ = ["main"]
