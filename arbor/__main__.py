"""``python -m arbor …`` is the ``arbor`` command."""

import sys

from arbor.cli import main

sys.exit(main())
