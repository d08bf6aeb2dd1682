"""Fixtures shared by the acceptance tests in this folder."""

from tests.acceptance.beat_support import beat_lab, scenario
from tests.acceptance.controls_lab import controls_lab

__all__ = ["beat_lab", "controls_lab", "scenario"]
