"""The `schedcc run` application: `launch` starts the ranks, `job` is what each rank does,
`models` holds the built-in models and data, `report` the progress bar and the summary.
"""

__all__: list[str] = []
