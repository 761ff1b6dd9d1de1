"""Built-in schedules, one file each, registered through the `schedcc.schedules` entry points."""

__all__: list[str] = []
