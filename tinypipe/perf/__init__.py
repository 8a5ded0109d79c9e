"""Performance measurement helpers: named workloads, machine rates, host-memory sampling, the
physical bound of a step (with and without recompute, and what the GPU memory forces) and the
measured step in parts (compute, recompute, exposed transfers and optimizer). The scripts in the
repository's ``bench/`` folder and ``tinypipe profile`` use them; named ``perf`` so that "bench"
means that folder alone."""
