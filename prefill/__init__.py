"""Prefill side: the vLLM KV-connector plugin and tandem's embedded prefill server."""
