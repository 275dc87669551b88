"""`zjax bench`: zjax vs GSPMD FSDP vs data parallel, measured side by side."""
