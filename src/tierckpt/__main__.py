"""``python -m tierckpt``: the command line (:func:`tierckpt.cli.main`), for a launcher that
names an interpreter rather than a ``tierckpt`` on PATH (the launch kit's ``srun`` step)."""

import sys

from tierckpt.cli import main

if __name__ == "__main__":
    sys.argv[0] = "tierckpt"  # usage lines and errors name the command, not the module
    main()
