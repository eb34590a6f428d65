"""Carbon-intensity providers: one interface, one shape of answer (IntensityPoint).

- :class:`ElectricityMapsProvider`: Electricity Maps API v4, or v3 while it answers (token).
- :class:`WattTimeProvider`: WattTime API v3 (username/password).
- :class:`UKCarbonIntensityProvider`: Great Britain, carbonintensity.org.uk (no key).
- :class:`TraceProvider`: a recorded CSV trace replayed with an adjustable clock.
- :class:`ConstantProvider`: one fixed value.
"""

from __future__ import annotations

from carbon.providers.base import CarbonProvider, HttpProvider, Secret
from carbon.providers.constant import ConstantProvider
from carbon.providers.electricitymaps import ElectricityMapsProvider
from carbon.providers.trace import (
    SHIPPED_TRACES,
    TraceProvider,
    TraceSeries,
    load_trace,
    shipped_trace_path,
)
from carbon.providers.uk import UK_REGIONS, UKCarbonIntensityProvider
from carbon.providers.watttime import WattTimeProvider

__all__ = [
    "SHIPPED_TRACES",
    "UK_REGIONS",
    "CarbonProvider",
    "ConstantProvider",
    "ElectricityMapsProvider",
    "HttpProvider",
    "Secret",
    "TraceProvider",
    "TraceSeries",
    "UKCarbonIntensityProvider",
    "WattTimeProvider",
    "load_trace",
    "shipped_trace_path",
]
