"""Command-line interface: `zjax train`, `zjax inspect`, `zjax bench` and `zjax launch`
(entry point: zjax.cli.main; one module per subcommand)."""
