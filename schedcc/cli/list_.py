"""`schedcc list`: the registered schedules, one line each, aliases grouped."""

from __future__ import annotations

from schedcc.registry import get_schedule, registered_schedules

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("list", help="list the registered schedules")
    parser.set_defaults(func=run)


def run(args) -> int:
    by_target: dict[str, list[str]] = {}
    for name, target in sorted(registered_schedules().items()):
        by_target.setdefault(target, []).append(name)
    rows = []
    for names in by_target.values():
        cls = get_schedule(names[0])
        primary = cls.name if cls.name in names else names[0]
        aliases = [n for n in names if n != primary]
        label = primary + (f" ({', '.join(aliases)})" if aliases else "")
        rows.append((label, cls.description()))
    width = max(len(label) for label, _ in rows)
    for label, text in sorted(rows):
        print(f"{label.ljust(width)}  {text}")
    return 0
