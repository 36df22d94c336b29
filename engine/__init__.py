"""Model runtime shared by the decode server and the embedded prefill engine."""
