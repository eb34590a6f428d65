"""Doctest collection of the packages (``--doctest-modules``, see pyproject.toml).

Modules built on an optional dependency are left out when that dependency is not
installed, so ``python -m pytest`` collects on a minimal install as on a full one.
"""

from __future__ import annotations

import importlib.util

# An optional distribution and the modules that import it at module level.
_OPTIONAL_MODULES = {
    "pytorch_lightning": ["lightning_energy/**/*pytorch_lightning.py"],
    "transformers": ["lightning_energy/**/transformers.py"],
    "deepspeed": [
        "lightning_energy/integrations/deepspeed.py",
        "tests/lightning_energy/integrations/deepspeed_worker.py",
    ],
    "megatron": ["tests/lightning_energy/integrations/megatron_worker.py"],
}

collect_ignore_glob = [
    pattern
    for distribution, patterns in _OPTIONAL_MODULES.items()
    if importlib.util.find_spec(distribution) is None
    for pattern in patterns
]
