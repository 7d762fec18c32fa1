"""``python -m arbor.cli …`` (how launched ranks re-run a command)."""

import sys

from arbor.cli import main

sys.exit(main())
