"""The self-check behind ``python -m lightning_store``: does ``store_on_cpu`` hold on this machine, at what cost."""

from lightning_store._selfcheck._cli import main

__all__ = ["main"]
