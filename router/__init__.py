"""OpenAI-compatible router: HTTP API, tokenization, P/D selection, streaming, metrics."""
