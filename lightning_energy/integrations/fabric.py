"""Energy optimisation for Lightning Fabric loops.

Fabric has no trainer, so the loop makes the calls a ``Trainer`` would make::

    from lightning.fabric import Fabric
    from lightning_energy.integrations.fabric import EnergyFabricCallback

    energy = EnergyFabricCallback(power_limit={"selector": "cost"})
    fabric = Fabric(accelerator="auto", devices=2, strategy="ddp", callbacks=[energy])
    fabric.launch()
    energy.setup(fabric)
    with energy:                             # an exception restores and writes the report
        for batch in loader:
            fabric.call("on_train_batch_start")
            ...  # forward, fabric.backward(loss), optimizer.step()
            fabric.call("on_train_batch_end")
            if energy.metrics_fresh:
                fabric.log_dict(energy.metrics)
        fabric.call("on_validation_start")   # pauses profiling while validating
    summary = energy.summary                 # the block's normal end finished the run

``fabric.save(path, {"model": model, "energy": energy})`` saves the profile (the callback
implements ``state_dict``/``load_state_dict``) so ``fabric.load`` resumes without
profiling again, also when it runs before :meth:`EnergyFabricCallback.setup`.

The loop behaves as without the callback: hooks called before ``setup`` (a loop calling
them for its other callbacks) do nothing, with one warning; the callback and a ``Fabric``
holding it pickle at any point (for ``ddp_spawn``), and a ``Fabric`` is never kept alive
by a run that ended.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from lightning_energy.controller import (
    EnergyController,
    Event,
    Interruption,
    StepEnd,
    StepResult,
    StepStart,
)
from lightning_energy.integrations.adapter import EnergyAdapter, tensor_collective

if TYPE_CHECKING:
    import torch

    from lightning_energy.controller import RunSummary

__all__ = ["EnergyFabricCallback"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Fabric(Protocol):
    """What the callback uses of a ``lightning.fabric.Fabric``."""

    @property
    def device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def all_gather(self, data: torch.Tensor) -> Any: ...

    def broadcast(self, obj: T, src: int = 0) -> T: ...


class EnergyFabricCallback(EnergyAdapter):
    """Power-limit optimisation driven from a Fabric loop.

    Takes the arguments of :class:`~lightning_energy.integrations.adapter.EnergyAdapter`
    (``config``, ``device``, ``power_limit``, ``carbon``, ``strict``, ``report``); the
    report is written when the run ends (:meth:`teardown`, or the ``with`` block).

    Raises:
        ConfigError: invalid configuration (before any GPU is touched).
    """

    ended_by: ClassVar[str] = "`with energy:` or `energy.teardown()`"
    _fresh = False
    _warned_before_setup = False

    def setup(self, fabric: _Fabric) -> None:
        """Open this rank's GPU and take its lease (call after ``fabric.launch()``).

        Idempotent while a run is open; after :meth:`teardown` it starts another run (a
        second training loop), which reuses the profile of a workload already profiled.
        A state loaded before (``fabric.load``) is resumed here.
        """
        if self.running:
            return
        collective = tensor_collective(
            fabric.global_rank,
            fabric.world_size,
            fabric.all_gather,
            fabric.broadcast,
            fabric.device,
        )
        controller = self.controller or EnergyController(
            self.config,
            collective=collective,
            local_rank=fabric.local_rank,
            node_rank=fabric.node_rank,
            device=fabric.device,
        )
        self._begin_run(controller, main_process=fabric.is_global_zero, collective=collective)

    def _hook(self, name: str, event: Event) -> StepResult:
        """Hand a hook's event to the run; before :meth:`setup` nothing happens, and the
        first such hook says so (a loop may call hooks for its other callbacks)."""
        if self.controller is not None:
            return self.controller.handle(event)
        if not self._warned_before_setup:
            self._warned_before_setup = True
            log.warning(
                "%s called before EnergyFabricCallback.setup(fabric): nothing is measured or "
                "changed until setup is called (after fabric.launch())",
                name,
            )
        return StepResult()

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        """Open a training step (``fabric.call("on_train_batch_start")``)."""
        self._hook("on_train_batch_start", StepStart())

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """Close a training step (``fabric.call("on_train_batch_end")``)."""
        self._fresh = self._hook("on_train_batch_end", StepEnd()).metrics is not None

    def on_validation_start(self, *args: Any, **kwargs: Any) -> None:
        """Leave validation out of the profiling window in progress."""
        self._hook("on_validation_start", Interruption("validation"))

    def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        """A profiling window must not span an epoch boundary."""
        self._hook("on_train_epoch_end", Interruption("epoch end"))

    def on_exception(self, exception: BaseException) -> None:
        """Restore every GPU and write the report (``fabric.call("on_exception", exc)``)."""
        self._abort(type(exception).__name__)

    def set_workload(self, key: str) -> None:
        """Declare a new workload (batch size or model change): it is profiled again.

        Build the key with :func:`~lightning_energy.integrations.adapter.workload_key`.

        Raises:
            EnergyError: before :meth:`setup` (the declaration would be lost).
        """
        if self.controller is None:
            from lightning_energy.errors import EnergyError

            raise EnergyError("call EnergyFabricCallback.setup(fabric) after fabric.launch()")
        self.controller.set_workload(key)

    @property
    def metrics_fresh(self) -> bool:
        """Whether the last training step closed a logging interval (new metrics)."""
        return self._fresh

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``energy/*`` metrics, for ``fabric.log_dict``."""
        return dict(self.controller.metrics) if self.controller is not None else {}

    def teardown(self) -> RunSummary | None:
        """Restore every GPU and return the run summary (idempotent until the next
        :meth:`setup`); on every rank at a normal end (the job's totals are a collective)."""
        return self._finish()
