"""Pure math and policy: interval planning, failure simulation, retention, units.

Torch-free, no I/O."""
