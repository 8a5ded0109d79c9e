"""Executes schedules: lanes (threads) per device stream, events, the CPU optimizer."""
