"""The parts of ``benchmarks/gpu/calibrate.py`` (see its docstring for what it measures).

* :mod:`.read_only`: a GPU and a ``pynvml`` module whose setters refuse (read-only runs);
* :mod:`.benches`: the two backends the phases run on (a real GPU with its CUDA workload,
  a simulated GPU on its virtual clock);
* :mod:`.run`: the run being made (budget, result, skipped phases, problems) and the
  measurement helpers every phase uses;
* :mod:`.observe`: the read-only phases;
* :mod:`.overhead`: the read-only controller run and the callback's cost per step;
* :mod:`.change`: the phases that change settings (``--change-settings`` only).

Nothing here imports ``carbon``, SQLAlchemy, APScheduler or platformdirs: the calibration
runs on a GPU machine's stock Python with the repository on ``sys.path`` and nothing
installed.
"""
