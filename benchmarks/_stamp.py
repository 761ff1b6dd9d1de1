"""The header line every benchmark prints above its table: commit, machine, torch, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["stamp"]


def stamp(benchmark: str) -> str:
    """`# NAME | commit abc1234 | host (processor, N CPUs) | torch X | YYYY-MM-DD HH:MM`."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    processor = platform.processor() or platform.machine()
    machine = f"{platform.node()} ({processor}, {os.cpu_count()} CPUs)"
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (
        f"# {benchmark} | commit {commit or 'unknown'} | {machine} | torch {torch_version} | {date}"
    )
