"""Drawing timelines: ASCII for the terminal, PNG/SVG paper figures, Chrome traces."""
