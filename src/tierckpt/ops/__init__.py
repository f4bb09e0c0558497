"""What the CLI does to checkpoints at rest: inventory, full checks, garbage collection."""
