"""Performance measurement helpers: named workloads, machine rates, host-memory sampling and the
physical bound of a step. The scripts in the repository's ``bench/`` folder and ``tinypipe profile``
use them; named ``perf`` so that "bench" means that folder alone."""
