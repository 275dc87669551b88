"""Collective and memory analysis of compiled programs (public API of zjax._src.hlo)."""

from zjax._src.hlo import Collective, collectives, summarize

__all__ = ["Collective", "collectives", "summarize"]
