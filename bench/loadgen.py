"""`python -m bench.loadgen`: the load generator, kept as an entry point here. The code is
kairos/loadgen.py (`kairos bench`), which kairos/demo.py and bench/ both import."""

from __future__ import annotations

import sys

from kairos.loadgen import main

if __name__ == "__main__":
    sys.exit(main())
