"""carbon: grid carbon intensity (providers, monitor, forecaster, accounting, config),
carbon-aware pacing (policy, planning) and the best time to start a job (window).

Usable on its own; it imports nothing from ``lightning_energy``.

Example:
    >>> from datetime import datetime, timezone
    >>> from carbon import TraceProvider, load_trace
    >>> provider = TraceProvider(load_trace("DE"),
    ...                          now=lambda: datetime(2023, 1, 1, 1, 30, tzinfo=timezone.utc))
    >>> provider.latest().intensity_g_per_kwh
    151.04
"""

from __future__ import annotations

from carbon.accounting import CarbonLedger, LedgerEntry, emissions_g
from carbon.config import (
    CarbonConfig,
    build_monitor,
    build_provider,
    load_carbon_config,
    parse_deadline,
)
from carbon.errors import (
    AccountingError,
    AuthError,
    BadResponseError,
    CarbonConfigError,
    CarbonError,
    NoDataError,
    ProviderError,
    ProviderUnavailableError,
    QuotaError,
    RegionNotInPlanError,
    TraceError,
)
from carbon.forecast import DailyProfileForecaster
from carbon.monitor import CarbonMonitor
from carbon.providers import (
    SHIPPED_TRACES,
    CarbonProvider,
    ConstantProvider,
    ElectricityMapsProvider,
    TraceProvider,
    TraceSeries,
    UKCarbonIntensityProvider,
    WattTimeProvider,
    load_trace,
    shipped_trace_path,
)
from carbon.types import IntensityPoint, PointKind, Reading, ReadingStatus
from carbon.window import StartWindow, best_start

__all__ = [
    "SHIPPED_TRACES",
    "AccountingError",
    "AuthError",
    "BadResponseError",
    "CarbonConfig",
    "CarbonConfigError",
    "CarbonError",
    "CarbonLedger",
    "CarbonMonitor",
    "CarbonProvider",
    "ConstantProvider",
    "DailyProfileForecaster",
    "ElectricityMapsProvider",
    "IntensityPoint",
    "LedgerEntry",
    "NoDataError",
    "PointKind",
    "ProviderError",
    "ProviderUnavailableError",
    "QuotaError",
    "Reading",
    "ReadingStatus",
    "RegionNotInPlanError",
    "StartWindow",
    "TraceError",
    "TraceProvider",
    "TraceSeries",
    "UKCarbonIntensityProvider",
    "WattTimeProvider",
    "best_start",
    "build_monitor",
    "build_provider",
    "emissions_g",
    "load_carbon_config",
    "load_trace",
    "parse_deadline",
    "shipped_trace_path",
]
