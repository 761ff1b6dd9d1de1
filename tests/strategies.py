"""Hypothesis strategies shared by the project's tests; the shape ones are schedcc.testing's."""

from __future__ import annotations

from schedcc.testing import Shape, schedules, shapes

__all__ = ["BUILTIN_SCHEDULES", "Shape", "schedules", "shapes"]

#: The built-in schedule names (one per class; aliases left out).
BUILTIN_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "2bw")
