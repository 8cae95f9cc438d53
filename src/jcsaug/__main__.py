"""``python -m jcsaug ...``: the ``jcsaug`` command (for an environment whose scripts folder is not on the PATH)."""

import sys

from jcsaug.cli import main

sys.exit(main())
