"""Floor 1: torch-free process and command-line helpers (logging, options, signals, durable files, settings).

Imports only the standard library and small packages; every install (the small inference one too) loads it."""
