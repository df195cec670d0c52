"""`python -m troupe ...`: the `troupe` command, for environments whose scripts folder is not on PATH."""

import sys

from troupe.cli import main

if __name__ == "__main__":
    sys.exit(main())
