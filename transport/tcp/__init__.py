"""Pure-Python TCP backend."""
