"""Plan: the parameter-use table, a config and a mesh -> a Schedule; predicted communication."""
