"""`python -m ninfer`: the same as the `ninfer` console script."""

import sys

from ninfer.cli.main import main

sys.exit(main())
