"""Running the ranks of a multi-process test: a free port, one process per rank, and a
failure that shows every rank's output."""

from __future__ import annotations

import os
import re
import signal
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


# What faulthandler (``PYTHONFAULTHANDLER=1``) prints for an abort: the error, then each
# thread's header and its frames, indented (the ones under test: "<no Python frame>").
_FAULT = re.compile(
    r"Fatal Python error: Aborted\n\n"
    r"((?:(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n(?:  .*\n?)+\n?)+)"
)


def aborted_at_exit(output: str) -> bool:
    """Whether a process's output shows it aborted in torch's C++ teardown at exit, after
    every line of Python it ran ("terminate called without an active exception", 1 in 40
    to 1 in 100 two-process launches here, after ``destroy_process_group``):
    faulthandler's dump for the abort lists no Python frame in any thread.

    Args:
        output: the process's stderr (or several processes'), with faulthandler enabled.
    """
    frames = [
        line
        for fault in _FAULT.finditer(output)
        for line in fault.group(1).splitlines()
        if line.startswith("  ")
    ]
    return (
        bool(frames)
        and "terminate called without an active exception" in output
        and all(line == "  <no Python frame>" for line in frames)
    )


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

    A launch whose only failures are ranks that aborted after their Python code had
    ended (:func:`aborted_at_exit`) runs again once, and the second is judged like the
    first: none of the code under test runs in such an abort.

    Args:
        commands: each rank's command line.
        log_dir: where the logs go.
        envs: each rank's environment (None: this process's).
        timeout_s: how long to wait for every rank.
    """
    logs = [log_dir / f"rank{r}.log" for r in range(len(commands))]
    environments = [
        {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
        for env in (envs or [None] * len(commands))
    ]
    codes = _run_once(commands, environments, logs, timeout_s)
    aborted = [
        code == -signal.SIGABRT and aborted_at_exit(log.read_text())
        for code, log in zip(codes, logs, strict=True)
    ]
    if any(aborted) and all(a or code == 0 for a, code in zip(aborted, codes, strict=True)):
        codes = _run_once(commands, environments, logs, timeout_s)
    if any(codes):
        output = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
        pytest.fail(f"{list(commands[0])} failed with exit codes {codes}:\n{output}")


def _run_once(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    logs: Sequence[Path],
    timeout_s: float,
) -> list[int]:
    """Each rank's exit status (killing every rank if one hangs)."""
    procs = []
    for command, env, log in zip(commands, envs, logs, strict=True):
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(
                    list(command), cwd=ROOT, env=dict(env), stdout=out, stderr=subprocess.STDOUT
                )
            )
    try:
        return [proc.wait(timeout=timeout_s) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_launch(
    command: Sequence[str], *, env: Mapping[str, str], timeout_s: float, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run a command that starts several ranks itself (``torch.distributed.run``, a
    Lightning DDP fit, ``accelerate launch``), its output captured and faulthandler on.

    A run that failed only by a rank aborting after its Python code had ended
    (:func:`aborted_at_exit`) runs again once, and the second is judged like the first.
    """

    def once() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(command),
            cwd=cwd,
            env={**env, "PYTHONFAULTHANDLER": "1"},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    done = once()
    if done.returncode != 0 and aborted_at_exit(done.stderr):
        done = once()
    return done


def run_module_ranks(module: str, rank_args: Sequence[Sequence[str]], log_dir: Path) -> None:
    """Run ``python -m module *args`` once per rank, as :func:`run_ranks`."""
    commands = [[sys.executable, "-m", module, *args] for args in rank_args]
    run_ranks(commands, log_dir, timeout_s=240)
