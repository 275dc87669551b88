"""The schedule as data: IR types, JSON files, validation, report and rendering."""
