"""Writes trials and power profiles to a store in a loop (run as a subprocess by the tests).

Usage: ``python store_writer.py URL WRITER COUNT [PAYLOAD_BYTES [FIRST_K]]``. After each committed
update it prints ``T <k>`` (trial ``k`` of this writer) or ``P <k>`` (profile ``k``) and
flushes, so the parent knows what is durable when it kills the process.
"""

from __future__ import annotations

import sys

from lightning_energy.store import JobId, Store, TrialRecord

JOB = JobId("crash-test", "Simulated A40", 1)


def trial(writer: str, k: int) -> TrialRecord:
    """The ``k``-th trial of ``writer``: every field derived from ``k`` (checkable)."""
    return TrialRecord(
        job=JOB,
        batch_size=k,
        power_limit_w=100.0 + k,
        epochs=k % 7,
        energy_j=10.0 * k,
        time_s=float(k),
        cost=15.0 * k,
        eta=0.5,
        converged=k % 2 == 0,
        started_at=float(k),
        finished_at=float(k) + 0.5,
        metric=k / 1000.0,
        run_id=f"{writer}-{k}",
    )


def profile(writer: str, k: int, payload_bytes: int) -> dict[str, object]:
    """Power-profile state ``k`` of ``writer``, with a payload and a checksum."""
    return {"writer": writer, "k": k, "check": 7 * k, "payload": "x" * payload_bytes}


def main() -> None:
    url, writer, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    payload_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    start = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    store = Store.open(url)
    store.register_job(JOB, {"purpose": "crash test"})
    print("ready", flush=True)
    for k in range(start, start + count):
        store.add_trial(trial(writer, k))
        print(f"T {k}", flush=True)
        store.save_power_profile(JOB, 1, profile(writer, k, payload_bytes))
        print(f"P {k}", flush=True)
    store.close()


if __name__ == "__main__":
    main()
