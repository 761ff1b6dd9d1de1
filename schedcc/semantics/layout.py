"""`Layout`: where each segment lives, read once from a schedule's placement."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from schedcc.schedule import Schedule

__all__ = ["Layout"]


@attrs.frozen(slots=True)
class Layout:
    """Where each segment lives: `segment[s][c]`, `stage_of[k]`, `chunk_of[k]`.

    >>> import schedcc
    >>> layout = Layout.of(schedcc.get_schedule("interleaved-1f1b")(2, 4, 2))
    >>> layout.segment, layout.stage_of, layout.last
    (((0, 2), (1, 3)), (0, 1, 0, 1), 3)
    """

    segment: tuple[tuple[int, ...], ...]
    stage_of: tuple[int, ...]
    chunk_of: tuple[int, ...]

    @classmethod
    def of(cls, schedule: Schedule) -> Layout:
        """The layout of `schedule`'s placement."""
        table = schedule.segment_table()
        num_segments = schedule.num_segments
        stage_of = [0] * num_segments
        chunk_of = [0] * num_segments
        for s, row in enumerate(table):
            for c, k in enumerate(row):
                stage_of[k], chunk_of[k] = s, c
        return cls(tuple(map(tuple, table)), tuple(stage_of), tuple(chunk_of))

    @property
    def num_stages(self) -> int:
        return len(self.segment)

    @property
    def num_segments(self) -> int:
        return len(self.stage_of)

    @property
    def last(self) -> int:
        """The last segment (the one that ends in the loss)."""
        return len(self.stage_of) - 1
