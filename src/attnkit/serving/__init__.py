"""Serving: a continuous-batching engine and the OpenAI-compatible HTTP server built on it."""
