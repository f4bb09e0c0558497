"""Reading checkpoints for evaluation, fine-tuning and serving: load, inspect, export."""
