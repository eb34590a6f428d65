"""lightning-energy: less energy and carbon for GPU training, without rewriting the loop."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
