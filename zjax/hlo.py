"""Collective and memory analysis of compiled programs (public API of zjax._src.hlo)."""

from zjax._src.hlo import (AnalysisProgram, AsyncCollective, Collective, async_collectives,
                           axes_of_groups, barrier_count, bytes_over, collectives,
                           compile_for_analysis, conditional_branches, executed,
                           executed_by_axis, executions, multiplicities, replica_groups,
                           summarize, while_loops)

__all__ = ["AnalysisProgram", "AsyncCollective", "Collective", "async_collectives",
           "axes_of_groups", "barrier_count", "bytes_over", "collectives",
           "compile_for_analysis", "conditional_branches", "executed", "executed_by_axis",
           "executions", "multiplicities", "replica_groups", "summarize", "while_loops"]
