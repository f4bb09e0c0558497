"""The restore path: verify before unpickling, agree on a step, load (resharding)."""
