#!/usr/bin/env bash
# `make test-latest`: build a throwaway venv with the newest versions that pyproject.toml's ranges
# allow (not the lock), print every package whose version differs from requirements/cpu.txt,
# then run the whole suite there. Drift shows up here before a user's fresh install meets it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LATEST_VENV:-.venv-latest}"
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch: pip sees the CPU build on this machine's disk through PIP_FIND_LINKS and prefers it
# (2.13.0+cpu sorts above 2.13.0); a range that admitted a newer torch would pull a CUDA build.
"$PY" -m pip install -q --upgrade --upgrade-strategy eager -e '.[worker,dev]'
"$PY" - <<'PY'
import re
from importlib.metadata import distributions

locked = {}
for line in open("requirements/cpu.txt"):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==([^ ;\\]+)", line)
    if m:
        locked[m.group(1).lower().replace("_", "-")] = m.group(2)
installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
diff = sorted((n, v, installed[n]) for n, v in locked.items() if n in installed and installed[n] != v)
print(f"{len(diff)} package(s) differ from requirements/cpu.txt:")
for name, lock_v, new_v in diff:
    print(f"  {name}: {lock_v} (lock) -> {new_v} (latest allowed)")
PY
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"
"$VENV/bin/pytest" -q "$@"
