"""Termination notices (signals, a trigger file, cloud metadata), the step every rank agrees
to stop at, and the emergency save carried to the most durable tier the grace allows."""
