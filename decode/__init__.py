"""Decode server: gRPC control service, admission of incoming KV, continuous batching."""
