"""`Layout`: where each segment lives, read once from a schedule's placement, and which model
replica each microbatch runs.

[Note: replicas] A schedule may hold several replicas of the model (`Schedule.num_replicas = R`,
DualPipe's two directions): replica r is the run of segments `r*L .. (r+1)*L - 1`
(`L = p*v / R`), and segment `r*L + j` is a copy of segment j, with the same parameters. Each
microbatch runs one replica (`Schedule.replica_of`), entering at its first segment and ending in
the loss at its last, and never touches the others' segments: so a segment's neighbours are those
of its replica, and a segment that starts (or ends) a replica takes the batch's inputs (or gives
the loss) whatever the microbatch. The compiler ties every segment to its copies
(`compile(tied=...)`'s mechanism: a `ReduceTied` per group sums the copies' gradients before the
step), so the replicas stay equal and training equals non-pipelined training of one copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from schedcc.errors import ScheduleConfigError, call_user_code

if TYPE_CHECKING:
    from schedcc.schedule import Schedule

__all__ = ["Layout"]


@attrs.frozen(slots=True)
class Layout:
    """Where each segment lives: `segment[s][c]`, `stage_of[k]`, `chunk_of[k]`; `replica[i]`,
    the model replica microbatch i of a batch runs (see [Note: replicas]).

    >>> import schedcc
    >>> layout = Layout.of(schedcc.get_schedule("interleaved-1f1b")(2, 4, 2))
    >>> layout.segment, layout.stage_of, layout.last
    (((0, 2), (1, 3)), (0, 1, 0, 1), 3)
    """

    segment: tuple[tuple[int, ...], ...]
    stage_of: tuple[int, ...]
    chunk_of: tuple[int, ...]
    replica: tuple[int, ...] = (0,)
    num_replicas: int = 1

    @classmethod
    def of(cls, schedule: Schedule) -> Layout:
        """The layout of `schedule`'s placement and replicas.

        Raises:
            ScheduleConfigError: `replica_of` gives a microbatch no replica in range.
        """
        table = schedule.segment_table()
        num_segments = schedule.num_segments
        stage_of = [0] * num_segments
        chunk_of = [0] * num_segments
        for s, row in enumerate(table):
            for c, k in enumerate(row):
                stage_of[k], chunk_of[k] = s, c
        replicas = type(schedule).num_replicas
        replica = [0] * schedule.num_microbatches
        if replicas > 1:
            owner = type(schedule).__name__
            for i in range(schedule.num_microbatches):
                r = call_user_code(owner, f"replica_of({i})", lambda i=i: schedule.replica_of(i))
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < replicas:
                    raise ScheduleConfigError(
                        f"{owner}.replica_of({i}) = {r!r}: expected a replica in range({replicas})"
                    )
                replica[i] = r
        return cls(
            tuple(map(tuple, table)), tuple(stage_of), tuple(chunk_of), tuple(replica), replicas
        )

    @property
    def num_stages(self) -> int:
        return len(self.segment)

    @property
    def num_segments(self) -> int:
        return len(self.stage_of)

    @property
    def place(self) -> tuple[tuple[int, int], ...]:
        """`(stage, chunk)` of each segment."""
        return tuple(zip(self.stage_of, self.chunk_of))

    @property
    def last(self) -> int:
        """The last segment of the last replica (the one that ends in the loss)."""
        return len(self.stage_of) - 1

    @property
    def replica_length(self) -> int:
        """`L`, the segments of one replica."""
        return len(self.stage_of) // self.num_replicas

    def is_first(self, segment: int) -> bool:
        """Whether `segment` starts its replica (it takes the batch's inputs)."""
        return segment % self.replica_length == 0

    def is_last(self, segment: int) -> bool:
        """Whether `segment` ends its replica (its output goes to the loss)."""
        return segment % self.replica_length == self.replica_length - 1

    @property
    def firsts(self) -> tuple[int, ...]:
        """The segments that start a replica."""
        return tuple(range(0, self.num_segments, self.replica_length))

    @property
    def lasts(self) -> tuple[int, ...]:
        """The segments that end a replica."""
        return tuple(range(self.replica_length - 1, self.num_segments, self.replica_length))

    def runs_per_batch(self, segment: int) -> int:
        """How many microbatches of a batch run `segment` (m with one replica)."""
        replica = segment // self.replica_length
        return sum(1 for r in self.replica if r == replica)

    def runs(self, microbatch: int, segment: int) -> bool:
        """Whether global microbatch `microbatch` runs `segment` (its replica holds it)."""
        replica = self.replica[microbatch % len(self.replica)]
        return segment // self.replica_length == replica
