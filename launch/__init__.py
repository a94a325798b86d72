"""Launchers: wire engines and drafters together (in-process, local processes)."""
