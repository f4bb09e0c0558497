"""The save path: host staging, the one background save, shard files (O_DIRECT)."""
