"""Collective and memory analysis of compiled programs (public API of zjax._src.hlo)."""

from zjax._src.hlo import (AnalysisProgram, Collective, axes_of_groups, bytes_over, collectives,
                           compile_for_analysis, conditional_branches, executed,
                           executed_by_axis, replica_groups, summarize, while_loops)

__all__ = ["AnalysisProgram", "Collective", "axes_of_groups", "bytes_over", "collectives",
           "compile_for_analysis", "conditional_branches", "executed", "executed_by_axis",
           "replica_groups", "summarize", "while_loops"]
