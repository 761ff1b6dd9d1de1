"""Executors (installed as `schedcc.backends`). Importing this package imports no torch.

- `engine`: the contract both engines keep;
- `local`: every stage in one process (the exact oracle); `distributed/`: one process per stage
  on `torch.distributed`;
- `runtime/`: what each instruction does to tensors on a stage, shared by both;
- `checkpoint/`: saving and restoring an engine's state;
- `reference`: non-pipelined training, what every pipelined run must equal;
- `run/`: the `schedcc run` application (launching ranks, the built-in models, the report).
"""

__all__: list[str] = []
