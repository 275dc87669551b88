"""Command-line interface: `zjax inspect` (more subcommands arrive with later features)."""
