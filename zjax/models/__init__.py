"""Models that ship with zjax (used by `zjax train`, the examples and the tests)."""
