"""Executors (installed as `schedcc.backends`): `runtime` says what each instruction does to
tensors; `local` runs every stage in one process, `distributed` one process per stage on
`torch.distributed`; `launch`, `job`, `models`, `report`, `reference`, `checkpoint` and `state`
serve them and `schedcc run`. Importing this package imports no torch; its modules do.
"""

__all__: list[str] = []
