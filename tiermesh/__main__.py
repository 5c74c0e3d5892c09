"""``python -m tiermesh ...`` == ``tiermesh ...`` (the harness starts agents this way)."""

import sys

from tiermesh.cli.main import main

sys.exit(main())
