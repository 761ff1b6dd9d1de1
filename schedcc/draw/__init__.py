"""Drawing timelines: ASCII for the terminal, PNG/SVG paper figures, Chrome traces.

- `schedcc.draw.ascii.render` — a row per stage, one column per time unit (`Timeline.to_ascii`).
- `schedcc.draw.figure.save` — the paper figure with matplotlib, imported lazily (`Timeline.save`).
- `schedcc.draw.chrome.save` — a timeline's Trace Event Format for Perfetto
  (`Timeline.to_chrome_trace`), written by `write_chrome_trace` from any
  `(stage, instruction, start, end)` events, simulated or measured.
"""

__all__: list[str] = []
