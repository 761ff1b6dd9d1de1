"""Checkpoints: `files` writes and reads the checkpoint directory atomically, `state` gathers a
stage runtime's state and re-shards it across data-parallel layouts, `restore` loads it back.
"""

__all__: list[str] = []
