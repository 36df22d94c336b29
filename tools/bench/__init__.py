"""tools.bench: a load generator for OpenAI-compatible servers (tandem's router, vLLM, ...)."""
