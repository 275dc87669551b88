"""Simulated CPU devices for the example scripts (what `zjax train` / `zjax bench` do)."""

from zjax.cli.devices import setup as setup_devices  # noqa: F401
