"""Benchmarks: measured side by side and reported, never asserted in the test suite."""
