"""Drawings: the ASCII timeline, PNG/SVG figures and Chrome traces are well formed."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

import schedcc
from schedcc import CostModel, ScheduleConfigError
from schedcc.draw.chrome import chrome_trace, write_chrome_trace


@pytest.fixture(scope="module")
def timeline():
    program = schedcc.compile(schedcc.get_schedule("1f1b")(4, 8))
    return schedcc.simulate(program, CostModel(comm=0.25))


def test_ascii_draws_a_row_per_stage_of_equal_width(timeline):
    """Plain output has a header and one equally wide row per stage, without escape codes."""
    lines = timeline.to_ascii(color=False, width=200).splitlines()
    assert len(lines) == 1 + timeline.num_stages
    rows = lines[1:]
    assert [row.split("|")[0].strip() for row in rows] == [f"stage {s}" for s in range(4)]
    assert len({len(row) for row in rows}) == 1
    assert "\x1b[" not in "".join(lines)


def test_ascii_gives_a_time_unit_a_column_and_a_block_its_microbatch():
    """GPipe p=2, m=2 at full scale: forwards `F0 F1`, backwards `B1 B0`, idle dots."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
    lines = schedcc.simulate(program).to_ascii(color=False, width=80).splitlines()
    assert lines[1] == "stage 0 |F0 F1 .........B1    B0    |"
    assert lines[2] == "stage 1 |...F0 F1 B1    B0    ......|"


def test_ascii_scales_a_long_timeline_to_the_width():
    """A timeline longer than the width is drawn in at most `width` columns."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(8, 64))
    rows = schedcc.simulate(program).to_ascii(color=False, width=60).splitlines()[1:]
    assert all(len(row.split("|")[1]) <= 60 for row in rows)


def test_ascii_colours_by_kind_when_asked(timeline):
    """With colour, forward and backward blocks carry their ANSI backgrounds."""
    text = timeline.to_ascii(color=True, width=200)
    assert "\x1b[30;44m" in text
    assert "\x1b[30;42m" in text
    assert text.endswith("\x1b[0m|")


def test_png_file_starts_with_the_png_magic(timeline, tmp_path):
    """save('x.png') writes a PNG."""
    path = timeline.save(tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_svg_file_has_an_svg_root_and_the_title(timeline, tmp_path):
    """save('x.svg') writes an SVG document whose title names the schedule and shape."""
    path = timeline.save(tmp_path / "t.svg")
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    assert "1f1b: p=4, m=8, v=1, bubble" in path.read_text()


def test_an_unknown_figure_suffix_is_a_config_error(timeline, tmp_path):
    """Only .png and .svg are figures; anything else says so."""
    with pytest.raises(ScheduleConfigError, match=r"\.png or \.svg"):
        timeline.save(tmp_path / "t.gif")


def test_chrome_trace_has_one_complete_event_per_instruction(timeline, tmp_path):
    """Every instruction is an "X" event on its stage's track, with microbatch and chunk."""
    data = json.loads(timeline.to_chrome_trace(tmp_path / "t.json").read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == timeline.program.num_instructions
    expected = sorted((e.stage, str(e.instruction)) for e in timeline.events)
    assert sorted((e["tid"], e["name"]) for e in complete) == expected
    forward = next(e for e in complete if e["name"] == "F3" and e["tid"] == 2)
    assert forward["args"]["microbatch"] == 3
    assert forward["args"]["chunk"] == 0
    assert data["otherData"]["schedule"] == "1f1b"


def test_chrome_trace_joins_each_send_to_its_receive(timeline, tmp_path):
    """One flow start ("s") per send and one finish ("f") with the same id on the peer stage."""
    data = json.loads(timeline.to_chrome_trace(tmp_path / "t.json").read_text())
    starts = {e["id"]: e for e in data["traceEvents"] if e["ph"] == "s"}
    finishes = {e["id"]: e for e in data["traceEvents"] if e["ph"] == "f"}
    sends = sum(op.group == "comm" and op.is_send for ops in timeline.program.stages for op in ops)
    assert len(starts) == sends
    assert starts.keys() == finishes.keys()
    assert all(starts[n]["tid"] != finishes[n]["tid"] for n in starts)
    assert all(starts[n]["ts"] <= finishes[n]["ts"] for n in starts)


def test_the_trace_writer_takes_plain_event_tuples(tmp_path):
    """A measured run's (stage, instruction, start, end) tuples in seconds export alike."""
    events = [(1, schedcc.Forward(0), 0.5, 1.5), (0, schedcc.Backward(2, 1), 2.0, 4.0)]
    path = write_chrome_trace(events, tmp_path / "m.json", unit_us=1e6)
    complete = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in complete] == [
        ("F0", 1, 5e5, 1e6),
        ("B2.1", 0, 2e6, 2e6),
    ]
    assert chrome_trace([])["traceEvents"][0]["ph"] == "M"


def test_ascii_width_below_one_column_is_a_config_error(timeline):
    """to_ascii(width=0) is refused with a ScheduleConfigError, not a division by zero."""
    with pytest.raises(ScheduleConfigError, match="width"):
        timeline.to_ascii(width=0)


def test_ascii_keeps_blocks_narrower_than_a_column():
    """At 2 time units a column, 0.1-unit forwards still mark their column: busy is not idle."""
    program = schedcc.compile(schedcc.get_schedule("gpipe")(2, 2))
    timeline = schedcc.simulate(program, schedcc.CostModel(forward=0.1, backward=10))
    rows = timeline.to_ascii(color=False, width=20).splitlines()[1:]
    assert rows[0].split("|")[1].startswith("F.")  # F0 and F1 share column 0
    assert rows[1].split("|")[1].startswith("B1")  # a wider block keeps its column


def test_a_block_on_a_later_chunk_never_reads_as_chunk_0():
    """Interleaved 1F1B with 3-column forwards: `F2.1` does not fit, so it shows `2.1`, never
    `F2` (which names chunk 0's forward)."""
    import re

    timeline = schedcc.simulate(schedcc.compile(schedcc.get_schedule("interleaved-1f1b")(2, 4, 2)))
    rows = timeline.to_ascii(color=False, width=200).splitlines()[1:]
    drawn = " ".join(rows)
    assert re.search(r"(?<![.\d])0\.1", drawn), drawn  # F0.1 as 0.1
    forwards = re.findall(r"F(\d)(?![.\d])", drawn)
    assert len(forwards) == 2 * 4, drawn  # chunk 0's forwards only, one per microbatch and stage
