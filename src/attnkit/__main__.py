"""``python -m attnkit`` runs the command line (``torchrun -m attnkit lab`` uses this too)."""

import sys

from attnkit.cli import main

sys.exit(main())
