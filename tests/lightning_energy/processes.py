"""Running the ranks of a multi-process test: a free port, one process per rank, and a
failure that shows every rank's output."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    commands: Sequence[Sequence[str]],
    log_dir: Path,
    *,
    envs: Sequence[Mapping[str, str] | None] | None = None,
    timeout_s: float = 300,
) -> None:
    """Run one command per rank from the repository root, each logging to
    ``log_dir/rank{r}.log``; fail the test (killing the others) if one fails or hangs,
    with the ranks' output in the message.

    Args:
        commands: each rank's command line.
        log_dir: where the logs go.
        envs: each rank's environment (None: this process's).
        timeout_s: how long to wait for every rank.
    """
    logs = [log_dir / f"rank{r}.log" for r in range(len(commands))]
    environments = envs or [None] * len(commands)
    procs = []
    for command, env, log in zip(commands, environments, logs, strict=True):
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(
                    list(command),
                    cwd=ROOT,
                    env=None if env is None else dict(env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [proc.wait(timeout=timeout_s) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(codes):
        output = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
        pytest.fail(f"{list(commands[0])} failed with exit codes {codes}:\n{output}")


def run_module_ranks(module: str, rank_args: Sequence[Sequence[str]], log_dir: Path) -> None:
    """Run ``python -m module *args`` once per rank, as :func:`run_ranks`."""
    commands = [[sys.executable, "-m", module, *args] for args in rank_args]
    run_ranks(commands, log_dir, timeout_s=240)
