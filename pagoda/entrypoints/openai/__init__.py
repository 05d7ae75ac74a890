"""pagoda.entrypoints.openai: the OpenAI-compatible HTTP server (`pagoda serve`)."""
