"""This machine's backend: the engine's supervisor, spare and kept ranks, the rendezvous."""

from .backend import KEEPER, LocalBackend

__all__ = ["KEEPER", "LocalBackend"]
