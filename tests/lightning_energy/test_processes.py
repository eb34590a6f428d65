"""The multi-process tests' launcher tells an abort in teardown from one in code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.lightning_energy.processes import aborted_at_exit

# Aborts the way torch's teardown does: C++ prints its message and calls abort() once the
# interpreter is finalizing, with no Python frame on any thread's stack (numpy loaded, so
# faulthandler lists extension modules after the threads, as it does under torch).
_ABORT_IN_TEARDOWN = """
import atexit, ctypes, sys
import numpy
sys.stderr.write("terminate called without an active exception\\n")
atexit.register(ctypes.CDLL(None).abort)
"""

# Aborts from Python code with the same message: a failure of the code under test.
_ABORT_IN_CODE = """
import os, sys
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


def _stderr_of(source: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    out = subprocess.run(
        [sys.executable, "-c", source], env=env, capture_output=True, text=True, check=False
    )
    return out.returncode, out.stderr


def test_an_abort_after_the_python_code_ended_is_recognised() -> None:
    code, stderr = _stderr_of(_ABORT_IN_TEARDOWN)
    assert code == -signal.SIGABRT
    assert aborted_at_exit(stderr), stderr


def test_an_abort_from_python_code_is_a_failure() -> None:
    code, stderr = _stderr_of(_ABORT_IN_CODE)
    assert code == -signal.SIGABRT
    assert not aborted_at_exit(stderr), stderr


def test_an_abort_without_the_teardown_message_is_a_failure() -> None:
    code, stderr = _stderr_of(_ABORT_IN_TEARDOWN.replace("terminate called", "something else"))
    assert code == -signal.SIGABRT
    assert not aborted_at_exit(stderr), stderr
