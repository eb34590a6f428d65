"""The demo: a real Lightning training run whose GPU side is simulated, on a virtual clock.

A small MLP learns a synthetic classification task with ``lightning.pytorch`` on the CPU
while :class:`~lightning_energy.integrations.lightning.EnergyCallback` drives a GPU:

- the GPU is simulated when none is present (``device.backend: auto``): an NVIDIA A40 by
  default, replaying the power traces Zeus (NSDI'23) measured for ImageNet/ResNet-50, so
  each training step costs the time and energy a real step costs at the current power
  limit. With a real NVIDIA GPU, it is used instead (and the model trains on it);
- the grid's carbon intensity is replayed from a real trace shipped with the package
  (``carbon/data/traces``: California ISO, Germany or France);
- the simulated GPU's virtual clock makes every step take the traced step time (about
  37 s on the A40), so a day of grid data passes in a few seconds of real time.

The callback profiles the power limits, picks one with the selector, then lets the
carbon-aware pacing policy re-choose it as intensity changes, within a deadline of 1.5x
the full-speed time (``--max-slowdown``). The least-energy limit alone already meets that
deadline, so the pace moves only through pauses; with ``--max-slowdown 1.04 --no-pause``
it must run faster part of the time and does so while the grid is cleanest. At the end
the demo prints the summary table (energy, time, power
limits, grams CO2eq and the savings against the carbon-unaware and full-power settings)
and, with ``report``, writes the run report.

Run it with ``lightning-energy demo`` or ``python examples/demo.py``.

Example:
    >>> report = run_demo(DemoOptions(steps=300, report="runs/demo.json"))  # doctest: +SKIP
    >>> report["summary"]["steps"]  # doctest: +SKIP
    300
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from lightning_energy.argtypes import float_in, int_in, positive_int
from lightning_energy.config import EnergyConfig

__all__ = [
    "DEFAULT_STEPS",
    "GPUS",
    "REGIONS",
    "DemoOptions",
    "add_arguments",
    "demo_config",
    "options_from_args",
    "run_demo",
]

#: Training steps of the default demo: about one day of grid data on the simulated A40.
DEFAULT_STEPS = 2400
#: A sunny, windy spring week: the traces swing widely through the day.
DEFAULT_START = "2023-04-17T00:00:00+00:00"
#: Simulated GPUs offered by ``--gpu`` (a Zeus-format CSV path is accepted too).
GPUS = ("a40", "v100", "a100", "h100")
#: The carbon-intensity traces shipped with the package.
REGIONS = ("CISO", "DE", "FR")
_SELECTORS = ("energy", "time", "cost", "max_slowdown")
_POLICIES = ("static", "threshold", "forecast")
_BACKENDS = ("auto", "simulated", "nvml")
_TRACE_SOURCES = {
    "CISO": "California ISO 2023, Electricity Maps (ODbL)",
    "DE": "Germany 2023, Electricity Maps (ODbL)",
    "FR": "France 2020, lets-wait-awhile / ENTSO-E (Wiesner et al., Middleware'21)",
}
_FEATURES = 32
_CLASSES = 4
_BATCH_SIZE = 64
_MAX_BATCHES = 2400
# Lightning's messages that say nothing about this demo (no logger, few workers, ...).
_QUIET_WARNINGS = (
    r".*but have no logger configured.*",
    r".*does not have many workers.*",
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
)
# Lightning's start-up lines, and the callback's short summary (the demo prints a fuller one).
_QUIET_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_energy.integrations._lightning_core",
    "lightning_energy.integrations.adapter",
)


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs.

    Attributes:
        gpu: the simulated GPU: ``a40``, ``v100`` (Zeus traces), ``a100``, ``h100``
            (physics presets) or a Zeus-format CSV.
        region: the carbon-intensity trace: ``CISO``, ``DE`` or ``FR``.
        steps: training steps.
        report: where to write the run report (None: no file).
        selector: the power-limit selector (``energy``, ``time``, ``cost``,
            ``max_slowdown``).
        seed: seeds the data, the model and the simulated GPU's noise.
        backend: ``auto`` (a real GPU when present, else simulated), ``simulated`` or
            ``nvml``.
        policy: the carbon pacing policy (``static``, ``threshold``, ``forecast``).
        progress: show Lightning's progress bar.
        start: when the simulated job starts (ISO 8601): the day of the trace replayed.
        allow_pause: let the carbon policy pause training (GPUs idle at the lowest
            limit) while the grid is dirty.
        max_slowdown: the deadline, as a factor of the full-speed time. The pace moves
            only when this is below the least-energy limit's slowdown (about 1.07 on the
            A40), or when pauses are allowed.
    """

    gpu: str = "a40"
    region: str = "DE"
    steps: int = DEFAULT_STEPS
    report: str | None = None
    selector: str = "cost"
    seed: int = 0
    backend: str = "auto"
    policy: str = "forecast"
    progress: bool = True
    start: str = DEFAULT_START
    allow_pause: bool = True
    max_slowdown: float = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (shared by the CLI and ``examples/demo.py``)."""
    parser.add_argument(
        "--gpu",
        default="a40",
        metavar="GPU",
        help="simulated GPU: a40, v100 (measured Zeus traces), a100, h100 (physics model) "
        "or the path of a Zeus-format power trace CSV (default: a40)",
    )
    parser.add_argument(
        "--region",
        default="DE",
        type=str.upper,
        choices=REGIONS,
        help="carbon-intensity trace to replay: CISO (California 2023), DE (Germany 2023), "
        "FR (France 2020) (default: DE)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=DEFAULT_STEPS,
        metavar="N",
        help=f"training steps (default: {DEFAULT_STEPS}, about a day of grid time on the A40)",
    )
    parser.add_argument("--report", metavar="PATH", help="write the run report (JSON) here")
    parser.add_argument(
        "--selector",
        default="cost",
        choices=_SELECTORS,
        help="how the power limit is chosen (default: cost, the Zeus energy-time cost)",
    )
    parser.add_argument(
        "--policy",
        default="forecast",
        choices=_POLICIES,
        help="carbon pacing policy (default: forecast)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=_BACKENDS,
        help="GPU backend: auto uses a real NVIDIA GPU when present (default: auto)",
    )
    parser.add_argument(
        "--start",
        default=DEFAULT_START,
        metavar="ISO_TIME",
        help="when the simulated job starts, i.e. which day of the trace is replayed (the "
        f"trace's year wraps around; default: {DEFAULT_START})",
    )
    parser.add_argument(
        "--no-pause",
        action="store_true",
        help="never pause training for a cleaner grid (pacing only changes the power limit)",
    )
    parser.add_argument(
        "--max-slowdown",
        type=float_in(1.0, 100.0),
        default=1.5,
        metavar="X",
        help="the deadline as a factor of the full-speed time (default: 1.5); below the "
        "least-energy limit's own slowdown (about 1.07 on the A40), e.g. 1.04 with "
        "--no-pause, the pace visibly follows the grid",
    )
    parser.add_argument(
        "--seed", type=int_in(0, 2**32 - 1), default=0, help="random seed (default: 0)"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar (for logs)"
    )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """The options parsed by a parser that :func:`add_arguments` set up."""
    return DemoOptions(
        gpu=args.gpu,
        region=args.region,
        steps=args.steps,
        report=args.report,
        selector=args.selector,
        seed=args.seed,
        backend=args.backend,
        policy=args.policy,
        progress=not args.no_progress,
        start=args.start,
        allow_pause=not args.no_pause,
        max_slowdown=args.max_slowdown,
    )


def demo_config(options: DemoOptions) -> EnergyConfig:
    """The energy configuration of the demo, validated before anything runs.

    Raises:
        ConfigError: an option is invalid (every problem is listed).
    """
    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": options.backend,
                "gpu": options.gpu,
                # Long simulated steps (about 37 s on the A40) so that the demo's steps
                # cover a day of grid data in a few minutes.
                "steps_per_epoch": 100,
                "noise_std": 0.02,
                "seed": options.seed,
                "start": options.start,
            },
            "power_limit": {"selector": options.selector},
            "carbon": {
                "provider": "trace",
                "region": options.region,
                "policy": options.policy,
                "max_slowdown": options.max_slowdown,
                "allow_pause": options.allow_pause,
            },
            "report": options.report,
            "log_every_n_steps": 10,
        },
        source="lightning-energy demo",
    )
    return config


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Hide Lightning's start-up chatter and irrelevant warnings for the demo's duration."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for pattern in _QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def _data(steps: int, seed: int) -> Any:
    """Gaussian blobs, one per class: enough batches for one epoch of ``steps`` (capped)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(seed)
    n = min(steps, _MAX_BATCHES) * _BATCH_SIZE
    centers = torch.randn(_CLASSES, _FEATURES, generator=generator) * 0.3
    labels = torch.randint(0, _CLASSES, (n,), generator=generator)
    features = centers[labels] + torch.randn(n, _FEATURES, generator=generator)
    return DataLoader(
        TensorDataset(features, labels),
        batch_size=_BATCH_SIZE,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def _model() -> Any:
    import torch
    from lightning.pytorch import LightningModule

    class DemoClassifier(LightningModule):
        """A two-hidden-layer MLP classifier."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(_FEATURES, 64),
                torch.nn.ReLU(),
                torch.nn.Linear(64, 64),
                torch.nn.ReLU(),
                torch.nn.Linear(64, _CLASSES),
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            accuracy = (logits.argmax(dim=1) == y).float().mean()
            self.log_dict({"loss": loss, "acc": accuracy}, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return DemoClassifier()


def _intro(options: DemoOptions, config: EnergyConfig) -> str:
    spec = config.device.simulated_spec()
    model = spec.model()
    device_s = options.steps * model.step_work()[0]
    length = f"{device_s / 3600:.0f} h" if device_s >= 3600 else f"{device_s / 60:.0f} min"
    return (
        f"lightning-energy demo: an MLP trains with Lightning for {options.steps} steps while "
        f"the energy callback\ndrives the GPU (a simulated {model.name} unless a real one "
        f"is present: {length} of device time at full power)\nand follows the {options.region} "
        f"grid's carbon intensity ({_TRACE_SOURCES[options.region]}),\nreplayed on the "
        "virtual clock. Power limits are profiled first, then paced by the carbon policy"
        + (
            "\n(which may pause training while the grid is dirty and the deadline allows it).\n"
            if options.allow_pause
            else ".\n"
        )
    )


def run_demo(options: DemoOptions, *, stream: TextIO | None = None) -> dict[str, Any]:
    """Run the demo and print its summary table.

    Args:
        options: what to run.
        stream: where the introduction and the summary are printed (default: stdout).

    Returns:
        The run report (the same data ``--report`` writes).

    Raises:
        ConfigError: an option is invalid (before training starts).
        EnergyError: the run failed.
    """
    out = stream if stream is not None else sys.stdout
    config = demo_config(options)
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightning_energy.integrations.lightning import EnergyCallback
    from lightning_energy.report import build_report, format_report

    print(_intro(options, config), file=out, flush=True)
    callback = EnergyCallback(config)
    callbacks: list[Any] = [callback]
    if options.progress:
        callbacks.append(TQDMProgressBar(refresh_rate=25))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    try:
        with _quiet_lightning():
            torch.manual_seed(options.seed)
            trainer = Trainer(
                max_steps=options.steps,
                accelerator="auto",
                devices=1,
                callbacks=callbacks,
                enable_progress_bar=options.progress,
                enable_checkpointing=False,
                enable_model_summary=False,
                logger=False,
                num_sanity_val_steps=0,
            )
            trainer.fit(_model(), train_dataloaders=_data(options.steps, options.seed))
    finally:
        torch.set_num_threads(threads)
    assert callback.controller is not None
    report = build_report(callback.controller)
    print("\nSummary\n" + format_report(report), file=out)
    if options.report:
        print(
            f"\nReport written to {options.report}; draw its plots with:\n"
            f"  lightning-energy report {options.report} --out PLOTS_DIR",
            file=out,
        )
    print(f"\nCarbon-intensity data: {_TRACE_SOURCES[options.region]}.", file=out)
    return report
