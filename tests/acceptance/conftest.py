"""Fixtures shared by the acceptance tests in this folder."""

from tests.acceptance.beat_support import beat_lab, scenario

__all__ = ["beat_lab", "scenario"]
