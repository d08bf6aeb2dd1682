"""The chaos campaign: faults drawn from a seed, mixed, against real processes; invariants.

``python -m tests.chaos --seed N --seconds S`` (``make chaos SEED=N SECONDS=S``) runs one
campaign; ``tests/chaos/test_chaos.py`` runs two short ones with fixed seeds (marker
``chaos``). See docs/reliability.md, "Chaos campaign".
"""
