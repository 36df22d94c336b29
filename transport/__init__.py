"""KV data plane: the Transport interface and its backends (nixl, mooncake, tcp, shm)."""
