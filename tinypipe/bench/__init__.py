"""Benchmarks: named workloads, machine rates, host-memory sampling and bound analysis."""
