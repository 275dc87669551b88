"""zjax internals, one folder per stage (docs/architecture.md):
program -> plan -> schedule -> layout -> execute -> train -> checkpoint; xla compiles."""
