"""Checkpoints: `files` writes and reads the checkpoint directory atomically, `state` gathers a
stage runtime's state and re-shards it across data-parallel layouts, `schema` checks every field
of a shard, `restore` checks that a shard fits and loads it back (`optimizer`: does its
optimizer state fit; `sharded`: ZeRO-3's parameter shards); `model` reads a checkpoint as one
model by parameter name (the whole model's state dict), and `reshape` loads it into another
shape so.
"""

__all__: list[str] = []
