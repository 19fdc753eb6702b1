"""The benchmark suite behind benchmarks/run.py (its command line), by concern: ``scenarios`` (the
models and their sizes, a row's identity), ``admission`` (memory claims and failures certain from
lower bounds), ``failures`` (reading how a child failed), ``child`` (one system in its own process),
``scheduler`` (starting children side by side, time limits, reruns alone), ``size_search`` (the
largest-model search), ``resume`` (going on from an earlier call's JSON), ``outputs`` (JSON,
markdown, chart), ``merging`` (joining runs), ``machine`` (the GPU, the host, the peers' wheels) and
``runner`` (one call of the suite from start to end). Its modules import benchmarks/ siblings
(peers, timeshare, trace_summary) as top-level names: benchmarks/ must be on sys.path, as run.py and
the tests put it.
"""
