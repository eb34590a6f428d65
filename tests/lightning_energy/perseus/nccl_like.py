"""Make the default process group behave like NCCL for this package's collectives.

On CUDA, Lightning's default backend is NCCL, which raises on CPU tensors. The workers of
the multi-process tests run on CPU with gloo, which accepts them, so a CPU tensor sent on the
default group would pass there and fail at the first step on GPUs. :func:`install` replaces
``torch.distributed`` as seen by this package's modules with a proxy whose default group
reports the ``nccl`` backend and raises, as NCCL does, on any CPU tensor; other groups
(the gloo side groups) and the frameworks' own collectives are untouched.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as real_dist

MODULES = (
    "lightning_energy.collectives",
    "lightning_energy.perseus.runtime.pipeline_run",
    "lightning_energy.perseus.runtime.online",
    "lightning_energy.perseus.runtime",
    "lightning_energy.perseus.data_parallel.straggler",
)

#: Tensor collectives and point-to-point operations, and which arguments carry tensors.
_TENSOR_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _is_default(group: Any) -> bool:
    return group is None or group is real_dist.group.WORLD


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(_tensors(value))
    return found


class NcclLikeDistributed:
    """``torch.distributed`` whose default group rejects CPU tensors."""

    def __getattr__(self, name: str) -> Any:
        real = getattr(real_dist, name)
        if name not in _TENSOR_OPS:
            return real
        return self._checked(name, real)

    @staticmethod
    def _checked(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _is_default(kwargs.get("group")):
                for tensor in _tensors([*args, *kwargs.values()]):
                    if tensor.device.type == "cpu":
                        raise RuntimeError(
                            f"{name}: No backend type associated with device type cpu "
                            "(NCCL takes CUDA tensors only)"
                        )
            return real(*args, **kwargs)

        return call

    @staticmethod
    def get_backend(group: Any = None) -> str:
        return "nccl" if _is_default(group) else str(real_dist.get_backend(group))


def install() -> None:
    """Give this package's modules the NCCL-like ``torch.distributed`` (this process)."""
    proxy = NcclLikeDistributed()
    for name in MODULES:
        module = importlib.import_module(name)
        module.dist = proxy  # type: ignore[attr-defined]
