"""XLA: what a compiled program does (collectives, memory) and how zjax compiles."""
