"""What the Lightning adapters use of a ``Trainer``, its strategy and the module.

The energy, batch-size and Perseus callbacks (:mod:`._lightning_core`,
:mod:`.batch_size`, :mod:`._perseus_core`) serve both Lightning namespaces, whose classes
differ, so they describe what they read in these ``Protocol`` s instead of naming either
namespace's ``Trainer``. Each names only what one of them uses; the type checker checks
``lightning.pytorch``'s own classes against them where the callbacks override its hooks.
Two attributes of a ``Trainer`` are set at run time by Lightning's connectors, so no
``Trainer`` class declares them: :func:`trainer_callbacks` and :func:`trainer_datamodule`
read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = ["Logger", "Module", "Strategy", "Trainer", "trainer_callbacks", "trainer_datamodule"]

T = TypeVar("T")


class Strategy(Protocol):
    """What the callbacks use of a Lightning strategy."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def model(self) -> torch.nn.Module | None: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, obj: T, src: int = 0) -> T: ...


class Logger(Protocol):
    """What the energy callback uses of a Lightning logger."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


class Trainer(Protocol):
    """What the callbacks use of a Lightning ``Trainer`` (either namespace)."""

    should_stop: bool

    @property
    def strategy(self) -> Strategy: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def global_step(self) -> int: ...

    @property
    def current_epoch(self) -> int: ...

    @property
    def max_epochs(self) -> int | None: ...

    @property
    def accumulate_grad_batches(self) -> int: ...

    @property
    def training(self) -> bool: ...

    @property
    def sanity_checking(self) -> bool: ...

    @property
    def estimated_stepping_batches(self) -> int | float: ...

    @property
    def train_dataloader(self) -> object: ...

    @property
    def callback_metrics(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def loggers(self) -> Sequence[Logger]: ...

    @property
    def progress_bar_callback(self) -> object: ...

    @property
    def state(self) -> Any: ...


class Module(Protocol):
    """What the callbacks use of a ``LightningModule`` (either namespace)."""

    def parameters(self, recurse: bool = True) -> Iterable[torch.nn.Parameter]: ...

    def log_dict(
        self,
        dictionary: Any,
        *,
        on_step: bool,
        on_epoch: bool,
        prog_bar: bool,
        logger: bool,
        batch_size: int,
    ) -> None: ...

    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool,
        on_epoch: bool,
        prog_bar: bool,
        logger: bool,
        batch_size: int,
    ) -> None: ...


def trainer_callbacks(trainer: Trainer) -> Sequence[object]:
    """``trainer.callbacks``, which Lightning's callback connector sets at run time (no
    ``Trainer`` class declares it)."""
    callbacks: Sequence[object] = getattr(trainer, "callbacks")  # noqa: B009
    return callbacks


def trainer_datamodule(trainer: Trainer) -> object:
    """``trainer.datamodule`` (None: none), which Lightning's data connector sets at run
    time (no ``Trainer`` class declares it)."""
    return getattr(trainer, "datamodule")  # noqa: B009
