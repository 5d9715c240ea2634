"""`python -m sim` runs `kairos sim`."""

import sys

from sim.cli import main

sys.exit(main())
