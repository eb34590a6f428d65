"""``lightning-energy doctor``: can this machine save energy, and if not, what to fix.

One line per check, ``OK``, ``WARN`` or ``FAIL``, each failure with its fix:

- NVML: the ``pynvml`` module imports and NVML initialises (no driver: the simulated GPU
  is used instead, which is fine for trying things out);
- GPUs: every visible GPU with its power-limit range, default and current limit;
- permissions: setting each GPU's current power limit back to itself (nothing changes) is
  allowed, or why not (no root/CAP_SYS_ADMIN, MIG, a zeusd that refuses). The check
  changes the GPU like a job does, through :class:`~lightning_energy.device.guard.GPUGuard`
  (and through zeusd where a job would go through it): with a lease, restored at once,
  and not at all while another job holds the GPU's lease;
- zeusd (when ``device.backend`` is ``zeusd``, or ``auto`` with ``ZEUSD_SOCK_PATH`` or
  ``ZEUSD_HOST_PORT`` set): the daemon answers ``/discover``, with its schema (which
  zeusd release), GPUs, enabled API groups (``gpu-control`` is needed) and whether it
  requires a token; then the token (``/auth/whoami``): whose it is, its scopes
  (``gpu-control`` is needed) and when it expires. The token is never printed;
- configuration: ``--config FILE`` (or ``$LIGHTNING_ENERGY_CONFIG``) is valid;
- carbon: the configured provider answers a ``latest`` request within ``--timeout``
  seconds and accepts the credentials (which are never printed);
- leases: the lease directory is safe (see docs/permissions.md) and writable, no killed
  job left a GPU changed, and no file in it is refused.

Examples::

    lightning-energy doctor
    lightning-energy doctor --config energy.yaml
    lightning-energy doctor --config energy.yaml --json

Exit codes: 0 nothing failed (warnings allowed), 1 a check failed, 2 the configuration is
invalid.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from lightning_energy.argtypes import float_in
from lightning_energy.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from lightning_energy.config import CONFIG_ENV_VAR, EnergyConfig, load_config
from lightning_energy.errors import (
    ConfigError,
    DaemonUnreachableError,
    DeviceError,
    EnergyError,
    LeaseConflictError,
    NoPermissionError,
    NotSupportedError,
    UntrustedLeaseError,
)

if TYPE_CHECKING:
    from lightning_energy.device.zeusd_client import Discovery, ZeusdClient

__all__ = ["Check", "register", "run", "run_checks"]

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_DRIVER_FIX = (
    "install the NVIDIA driver (it provides libnvidia-ml.so) and the nvidia-ml-py package "
    "(installed with lightning-energy); in a container use the NVIDIA Container Toolkit "
    "(`docker run --gpus all`)"
)
_LEASE_OPERATIONS = ("lease_dir", "read_lease", "write_lease", "lock_lease", "remove_lease")
_LEASE_FIX = "see the leases line below and docs/permissions.md"
_ZEUSD_FIX = "see the zeusd lines below and docs/permissions.md"


@dataclass(frozen=True)
class Check:
    """The outcome of one check.

    Attributes:
        name: what was checked (``nvml``, ``gpu 0``, ``gpu 0 perms``, ``zeusd``,
            ``zeusd token``, ``config``, ``carbon``, ``leases``).
        status: ``OK``, ``WARN`` or ``FAIL``.
        message: what was found.
        fix: what to do about it (None when nothing is needed).
    """

    name: str
    status: str
    message: str
    fix: str | None = None


def register(subparsers: Any) -> None:
    """Add the ``doctor`` subcommand."""
    parser = subparsers.add_parser(
        "doctor",
        help="check NVML, GPUs, permissions, zeusd, configuration, carbon provider and leases",
        description="Check what lightning-energy needs on this machine and say how to fix "
        "what is missing. Nothing is changed.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"YAML configuration to check (default: ${CONFIG_ENV_VAR} when set)",
    )
    parser.add_argument(
        "--timeout",
        type=float_in(0, 600, low_inclusive=False),
        default=5.0,
        metavar="SECONDS",
        help="timeout of the carbon provider request (default: 5)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run every check and print the results; returns the exit code."""
    checks, config_ok = run_checks(args.config, timeout_s=args.timeout)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<4}  {c.name:<{width}}  {c.message}")
            if c.fix:
                print(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    if not config_ok:
        return EXIT_USAGE
    return EXIT_FAILURE if any(c.status == FAIL for c in checks) else EXIT_OK


def run_checks(config_path: str | None, *, timeout_s: float = 5.0) -> tuple[list[Check], bool]:
    """Run every check.

    Args:
        config_path: the configuration file to check (None: ``$LIGHTNING_ENERGY_CONFIG``
            when set, else the defaults).
        timeout_s: timeout of the carbon provider request.

    Returns:
        The checks in order, and whether the configuration was valid.
    """
    checks: list[Check] = []
    config, config_check = _load(config_path)
    backend = config.device.backend if config is not None else "auto"
    daemon, zeusd_checks = _zeusd_checks(backend)
    lease_dir = config.device.lease_dir if config is not None else None
    checks.extend(_nvml_checks(backend, lease_dir, daemon))
    checks.extend(zeusd_checks)
    checks.append(config_check)
    if config is not None and config.carbon is not None:
        checks.append(_carbon_check(config, timeout_s))
    checks.extend(_lease_checks(config))
    return checks, config_check.status != FAIL


def _load(path: str | None) -> tuple[EnergyConfig | None, Check]:
    source = path or os.environ.get(CONFIG_ENV_VAR, "").strip() or None
    try:
        config = load_config(path)
    except ConfigError as exc:
        return None, Check("config", FAIL, str(exc), "correct the keys listed above")
    if config is None:
        return EnergyConfig(), Check("config", OK, "no configuration file: the defaults apply")
    carbon = f", carbon: {config.carbon.provider} {config.carbon.region}" if config.carbon else ""
    return config, Check(
        "config",
        OK,
        f"{source} is valid (device backend {config.device.backend}, selector "
        f"{config.power_limit.selector}{carbon})",
    )


# --------------------------------------------------------------------------- NVML
def _nvml_checks(
    backend: str, lease_dir: str | None, daemon: ZeusdClient | None
) -> Iterator[Check]:
    """NVML, its GPUs and the permission to change each (through ``daemon`` if given)."""
    from lightning_energy.device.nvml import NVMLSession, nvml_gpus
    from lightning_energy.device.zeusd import gpu_factory

    try:
        session = NVMLSession()
    except DeviceError as exc:
        if backend == "simulated":
            yield Check("nvml", OK, f"not available ({exc}); not needed: the backend is simulated")
        elif backend in ("nvml", "zeusd"):
            yield Check(
                "nvml", FAIL, f"not available ({exc}) but device.backend is {backend}", _DRIVER_FIX
            )
        else:
            yield Check(
                "nvml",
                WARN,
                f"not available ({exc}): lightning-energy will use the simulated GPU "
                "(device.backend: auto), which replays measured traces; real GPUs are "
                "neither measured nor changed",
                _DRIVER_FIX + " to drive real GPUs",
            )
        return
    try:
        try:
            gpus = nvml_gpus(factory=gpu_factory(daemon))
        except (DeviceError, ConfigError) as exc:
            yield Check(
                "nvml",
                FAIL,
                f"NVML initialised but the GPUs cannot be listed: {exc}",
                "check CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER and `nvidia-smi -L`",
            )
            return
        if not gpus:
            real = backend in ("nvml", "zeusd")
            yield Check(
                "nvml",
                FAIL if real else WARN,
                "NVML works but no GPU is visible"
                + ("" if real else ": the simulated GPU will be used"),
                "check CUDA_VISIBLE_DEVICES and `nvidia-smi -L`",
            )
            return
        yield Check("nvml", OK, f"NVML initialised; {len(gpus)} GPU(s) visible")
        try:
            for gpu in gpus:
                yield from _gpu_checks(gpu, lease_dir)
        finally:
            for gpu in gpus:
                gpu.close()
    finally:
        session.release()


def _gpu_checks(gpu: Any, lease_dir: str | None) -> Iterator[Check]:
    name = f"gpu {gpu.index}"
    try:
        lo, hi = gpu.power_limit_constraints_w()
        default_w = gpu.default_power_limit_w()
        current_w = gpu.power_limit_w()
    except DeviceError as exc:
        yield Check(
            name,
            FAIL,
            f"{gpu.name}: cannot read the power limits: {exc}",
            "check the GPU with `nvidia-smi -q -d POWER`",
        )
        return
    mig = " (MIG)" if gpu.is_mig else ""
    yield Check(
        name,
        OK,
        f"{gpu.name}{mig} {gpu.uuid}: power limit {current_w:.0f} W, range {lo:.0f}-{hi:.0f} W, "
        f"default {default_w:.0f} W",
    )
    yield _permission_check(gpu, f"{name} perms", current_w, lease_dir)


def _permission_check(gpu: Any, name: str, current_w: float, lease_dir: str | None) -> Check:
    """Set the GPU's current limit back to itself, the way a job changes it: through a
    guard, with a lease, restored at once; never under another job's lease."""
    from lightning_energy.device.guard import PERMISSION_HELP, GPUGuard

    try:
        with GPUGuard([gpu], lease_dir=lease_dir, strict=True) as guard:
            guard.set_power_limit_w(current_w)
    except LeaseConflictError as exc:
        return Check(name, WARN, f"not checked, nothing changed: {exc}")
    except NoPermissionError as exc:
        return Check(
            name,
            FAIL,
            "no permission to change the power limit: jobs will run observe-only "
            "(energy measured, nothing saved)",
            exc.fix or PERMISSION_HELP,
        )
    except NotSupportedError as exc:
        return Check(name, WARN, f"settings cannot be changed ({exc}): observe-only")
    except DaemonUnreachableError as exc:
        return Check(name, FAIL, f"not checked, nothing changed: {exc}", _ZEUSD_FIX)
    except DeviceError as exc:
        if exc.operation in _LEASE_OPERATIONS:
            return Check(name, WARN, f"not checked, nothing changed: {exc}", _LEASE_FIX)
        return Check(
            name,
            FAIL,
            f"setting the power limit failed: {exc}",
            "check the driver with `nvidia-smi -q -d POWER`",
        )
    return Check(name, OK, "may change the power limit (checked without changing it)")


# --------------------------------------------------------------------------- zeusd
def _zeusd_checks(backend: str) -> tuple[ZeusdClient | None, list[Check]]:
    """The zeusd a job with ``backend`` would change settings through (None: none), and the
    checks of it: none where no daemon is involved."""
    from lightning_energy.device.zeusd import daemon_for_backend
    from lightning_energy.device.zeusd_client import ZeusdClient

    if backend not in ("auto", "zeusd"):
        return None, []
    try:
        configured = ZeusdClient.from_env()
        daemon = daemon_for_backend(backend)
    except ConfigError as exc:
        return None, [Check("zeusd", FAIL, "; ".join(exc.problems), "see docs/permissions.md")]
    if daemon is not None:
        return daemon, _daemon_checks(daemon)
    if configured is None:
        return None, []
    return None, [
        Check(
            "zeusd",
            OK,
            f"{configured.address} is configured, but this process changes GPU settings itself "
            "(root or CAP_SYS_ADMIN): NVML is used (device.backend: zeusd uses the daemon)",
        )
    ]


def _daemon_checks(daemon: ZeusdClient) -> list[Check]:
    """Whether ``daemon`` answers and may change GPU settings, then its token."""
    from lightning_energy.device.zeusd_client import CONTROL_SCOPE

    try:
        found = daemon.discover()
    except DaemonUnreachableError as exc:
        fix = (
            "start zeusd (docs/permissions.md), or set ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT to "
            "where it listens"
        )
        return [Check("zeusd", FAIL, str(exc), fix)]
    except DeviceError as exc:
        fix = "check the daemon's log (`journalctl -u zeusd`); zeusd 0.4 or later is needed"
        return [Check("zeusd", FAIL, str(exc), fix)]
    auth = "a token is required" if found.auth_required else "no token is required"
    message = (
        f"{daemon.address}: {found.describe_schema()}, {len(found.gpus)} GPU(s), API groups "
        f"{', '.join(found.api_groups) or 'none'}; {auth}"
    )
    if CONTROL_SCOPE in found.api_groups:
        daemon_check = Check("zeusd", OK, message)
    else:
        daemon_check = Check(
            "zeusd",
            FAIL,
            f"{message}: it may not change GPU settings, jobs will run observe-only",
            f"start zeusd with `--enable {CONTROL_SCOPE}` (or without --enable: all groups)",
        )
    return [daemon_check, _token_check(daemon, found)]


def _token_check(daemon: ZeusdClient, found: Discovery) -> Check:
    """Whose the token is and whether it may change GPU settings (never the token)."""
    from lightning_energy.device.zeusd_client import CONTROL_SCOPE, SCOPE_FIX, TOKEN_ENV, TOKEN_FIX

    name = "zeusd token"
    if not found.auth_required:
        return Check(name, OK, "the daemon requires no token")
    if not daemon.has_token:
        return Check(
            name, FAIL, f"the daemon requires a token and {TOKEN_ENV} is not set", TOKEN_FIX
        )
    try:
        who = daemon.whoami()
    except NoPermissionError as exc:
        return Check(name, FAIL, str(exc), exc.fix)
    except DeviceError as exc:
        return Check(name, FAIL, str(exc), "check the daemon's log (`journalctl -u zeusd`)")
    expires = (
        "never expires"
        if who.exp is None
        else f"expires {datetime.fromtimestamp(who.exp, timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    message = f"the token of {who.sub}: scopes {', '.join(who.scopes) or 'none'}; {expires}"
    if CONTROL_SCOPE in who.scopes:
        return Check(name, OK, message)
    return Check(
        name,
        FAIL,
        f"{message}; it lacks the scope {CONTROL_SCOPE}: jobs will run observe-only",
        SCOPE_FIX,
    )


# --------------------------------------------------------------------------- carbon
def _carbon_check(config: EnergyConfig, timeout_s: float) -> Check:
    from carbon.config import build_provider
    from carbon.errors import (
        AuthError,
        CarbonError,
        ProviderUnavailableError,
        QuotaError,
        RegionNotInPlanError,
    )

    carbon = config.carbon
    assert carbon is not None
    where = f"{carbon.provider} {carbon.region or ''}".strip()
    region = f"region {carbon.region}" if carbon.region else "no region"  # errors name the provider
    http: dict[str, Any] = {}
    if carbon.provider in ("electricitymaps", "watttime", "uk"):
        http = {"timeout_s": (timeout_s, timeout_s), "max_retries": 0}
    credential = {
        "electricitymaps": f" (token from ${carbon.token_env or 'ELECTRICITYMAPS_TOKEN'} accepted)",
        "watttime": " (credentials accepted)",
    }.get(carbon.provider, "")
    provider: Any = None
    try:
        provider = build_provider(carbon, **http)
        point = provider.latest()
    except AuthError as exc:
        return Check(
            "carbon",
            FAIL,
            f"{region}: {exc}",
            "check the token/credentials in the environment variables named in the "
            "carbon section (see docs/carbon.md)",
        )
    except RegionNotInPlanError as exc:
        return Check(
            "carbon",
            FAIL,
            f"{region}: {exc}",
            "choose a region your plan covers, or upgrade the plan (docs/carbon.md)",
        )
    except QuotaError as exc:
        return Check(
            "carbon",
            WARN,
            f"{region}: rate limited: {exc}",
            "poll less often (carbon.poll_interval_s) or use a bigger plan",
        )
    except ProviderUnavailableError as exc:
        return Check(
            "carbon",
            FAIL,
            f"{region}: unreachable: {exc}",
            "check the network/proxy from this machine; during training an outage "
            "falls back to the last value, then carbon.fallback",
        )
    except CarbonError as exc:
        return Check("carbon", FAIL, f"{region}: {exc}", "see docs/troubleshooting.md")
    finally:
        close = getattr(provider, "close", None)
        if callable(close):
            close()
    return Check(
        "carbon",
        OK,
        f"{where}: {point.intensity_g_per_kwh:.0f} gCO2eq/kWh at "
        f"{point.time:%Y-%m-%d %H:%M} UTC{credential}",
    )


# --------------------------------------------------------------------------- leases
def _lease_checks(config: EnergyConfig | None) -> Iterator[Check]:
    from lightning_energy.device.lease import LEASE_DIR_ENV, LeaseStore
    from lightning_energy.device.recovery import recover

    store = LeaseStore(config.device.lease_dir if config is not None else None)
    lease_dir = store.directory
    fix = (
        f"create {lease_dir} as root with mode 1777 (`install -d -m 1777 {lease_dir}`), or set "
        f"{LEASE_DIR_ENV} (or device.lease_dir) to such a directory on a local disk"
    )
    try:
        store.ensure_directory()
        with tempfile.NamedTemporaryFile(dir=lease_dir, prefix=".doctor-"):
            pass
    except UntrustedLeaseError as exc:
        yield Check("leases", FAIL, str(exc), fix)
        return
    except (OSError, DeviceError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        yield Check("leases", FAIL, f"{lease_dir} is not writable: {why}", fix)
        return
    yield Check("leases", OK, f"{lease_dir} is writable and safe")
    try:
        results = recover(lease_dir, dry_run=True)
    except EnergyError as exc:
        yield Check("leases", WARN, f"the leases in {lease_dir} cannot be read: {exc}")
        return
    stale = [r for r in results if r.status == "would_restore"]
    if stale:
        gpus = ", ".join(r.gpu_uuid for r in stale)
        yield Check(
            "leases",
            WARN,
            f"{len(stale)} GPU(s) left changed by jobs that were killed: {gpus}",
            "run `lightning-energy recover` (the next job on those GPUs also repairs them)",
        )
    refused = [r for r in results if r.status == "refused"]
    if refused:
        files = "; ".join(f"{r.lease_path.name}: {r.message}" for r in refused)
        yield Check(
            "leases",
            WARN,
            f"{len(refused)} file(s) are refused (never acted on): {files}",
            "check who wrote them, then delete them (docs/troubleshooting.md)",
        )
