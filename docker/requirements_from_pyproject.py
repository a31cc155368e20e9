"""Print pyproject.toml's runtime dependencies, one per line, minus the names given with --exclude.

Both images install dependencies in their own layer before the source is copied, so a code
change does not reinstall them; this script is how that layer learns the list without a second,
hand-kept copy of it. Usage: python requirements_from_pyproject.py pyproject.toml [--exclude torch ...]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def dependency_name(requirement: str) -> str:
    """`"uvicorn[standard]>=0.30"` -> `"uvicorn"` (PEP 503 normalised)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read a package name from requirement {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, exclude: set[str]) -> list[str]:
    deps: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    excluded = {dependency_name(e) for e in exclude}
    unknown = excluded - {dependency_name(d) for d in deps}
    if unknown:
        # A stale exclusion list would silently stop excluding anything: fail the build instead.
        raise SystemExit(f"--exclude names not in {pyproject}: {', '.join(sorted(unknown))}")
    return [d for d in deps if dependency_name(d) not in excluded]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--exclude", nargs="*", default=[])
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.pyproject, set(args.exclude))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
