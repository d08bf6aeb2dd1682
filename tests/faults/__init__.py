"""Fault-injection tier: real faults injected into real worker and beat processes."""
