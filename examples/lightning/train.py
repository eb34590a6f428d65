"""LightningCLI example: the energy callback and the grid region live in the YAML file.

    python examples/lightning/train.py fit --config examples/lightning/cli.yaml

``cli.yaml`` lists ``lightning_energy.integrations.lightning.EnergyCallback`` under
``trainer.callbacks`` with its ``init_args``: the power-limit selector, the device (a
simulated A40 when no NVIDIA GPU is present) and a ``carbon`` section replaying the German
grid's 2023 carbon intensity. Any key can be overridden on the command line, e.g.
``--trainer.max_steps 600``. The run report is written to
``runs/lightning_cli/energy.json``; ``lightning-energy report runs/lightning_cli/energy.json
--out runs/plots`` draws it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI
from model import BlobData, Classifier


def main(args: Sequence[str] | None = None) -> LightningCLI:
    """Run the CLI (``args`` default to the command line)."""
    return LightningCLI(
        Classifier,
        BlobData,
        args=list(args) if args is not None else None,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
