"""The demo as a script: the same as ``lightning-energy demo`` (same options).

    python examples/demo.py --report runs/demo.json
    python examples/demo.py --gpu v100 --region CISO --steps 4800

A small MLP trains with Lightning on CPU while the energy callback drives a simulated GPU
(a real one when present) and follows a real carbon-intensity trace on a virtual clock.
See ``lightning_energy/demo.py`` for how it is built.
"""

from __future__ import annotations

import sys

from lightning_energy.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
