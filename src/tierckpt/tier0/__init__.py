"""Tier 0: checkpoints in node RAM (tmpfs) that outlive a worker restart, with a
replica on a partner node."""
