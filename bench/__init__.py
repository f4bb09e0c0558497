"""`make bench`: tierckpt's save, restore and upload paths against physical limits and plain DCP.

Run as ``python -m bench.run [--size 1GiB] [--quick] [--world 1,2] [--out bench/results]``.
Modules by job: ``limits`` (what the machine can do), ``dcp_peers`` (plain DCP and torch.save),
``tierckpt_paths`` (the same through ``tierckpt.CheckpointManager``), ``transfer`` (the
upload/download hook), ``targets`` (the issue's goals as pure functions of the numbers),
``report`` (JSON + Markdown). See docs/benchmarks.md.
"""
