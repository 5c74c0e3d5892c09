"""``python -m edge_agent --site NAME ...`` == ``tiermesh agent --site NAME ...``."""

import sys

from mesh.cli import main

sys.exit(main(["agent", *sys.argv[1:]]))
