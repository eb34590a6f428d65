"""``python -m lightning_energy`` runs the command line."""

import sys

from lightning_energy.cli import main

sys.exit(main())
