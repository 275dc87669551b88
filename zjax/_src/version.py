"""zjax's version, in one place below everything that reads it (the package re-exports it;
checkpoint manifests record it)."""

__version__ = "0.1.0"
