"""Measurement helpers that only the benchmarks in ``bench/`` and their tests use: named workloads
(W1, W3, tiny), host-memory sampling, the physical bound of a step (with and without recompute,
and what the GPU memory forces) and the measured step in parts (compute, recompute, exposed
transfers and optimizer). Not part of the ``tinypipe`` package: a script run as ``python
bench/X.py`` finds it beside itself (``bench/`` is its ``sys.path[0]``), a script in
``bench/archive/`` puts ``bench/`` on its path, and tests/conftest.py appends ``bench/`` to the
tests' path. The machine-rate probes (:mod:`tinypipe.devices.rates`) stay in the library:
``tinypipe profile`` uses them."""
