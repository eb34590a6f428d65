"""Imports modules in a fresh interpreter and prints which modules of a prefix got loaded.

``python -m tests.import_probe --prefix PREFIX [--prefix PREFIX...] MODULE...`` imports each
``MODULE`` and prints, as a JSON list, the names in ``sys.modules`` equal to a ``PREFIX`` or
under it. The tests use it to check that importing one package does not import another.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def loaded_under(prefix: str) -> list[str]:
    """The loaded modules named ``prefix`` or ``prefix.<anything>``, sorted."""
    return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix", required=True, action="append")
    parser.add_argument("modules", nargs="+")
    args = parser.parse_args()
    for module in args.modules:
        importlib.import_module(module)
    print(json.dumps([name for prefix in args.prefix for name in loaded_under(prefix)]))


if __name__ == "__main__":
    main()
