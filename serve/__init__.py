"""The family's server: HTTP API, web routes, OpenAI shapes and the model worker."""
