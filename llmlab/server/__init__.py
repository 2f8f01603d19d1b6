"""Front ends: the command line (and, later, the OpenAI-compatible HTTP server)."""
