"""Collective and memory analysis of compiled programs (public API of zjax._src.hlo)."""

from zjax._src.hlo import (Collective, collectives, conditional_branches, executed, summarize,
                           while_loops)

__all__ = ["Collective", "collectives", "conditional_branches", "executed", "summarize",
           "while_loops"]
