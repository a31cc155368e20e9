"""Settings in one place: no module but service/settings.py reads a `LORAQ_` variable, and the
README's configuration table lists every setting."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("service", "worker", "gpu_kernels", "scripts", "bench", "migrations")
SETTINGS_MODULE = ROOT / "service" / "settings.py"
# Set by the code for its own child processes, never by a user: the worker's main process names
# its node for the pool children it forks after its settings were read (worker/metrics/registry.py).
CHILD_PLUMBING = {"LORAQ_WORKER_NODE"}


def _loraq_name(node: ast.expr, constants: dict[str, str]) -> str | None:
    """The LORAQ_ name `node` evaluates to: a literal, a module constant, or an f-string's prefix."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        value: str | None = node.value
    elif isinstance(node, ast.Name):
        value = constants.get(node.id)
    elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        value = str(node.values[0].value)
    else:
        value = None
    return value if value is not None and value.startswith("LORAQ_") else None


def _is_environ(node: ast.expr) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


def loraq_env_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every read of a LORAQ_ environment variable in `source`: `os.getenv(N)`,
    `os.environ.get/pop/setdefault(N)`, `os.environ[N]` (not as an assignment target), `N in os.environ`."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: list[tuple[int, str]] = []

    def note(node: ast.AST, arg: ast.expr) -> None:
        name = _loraq_name(arg, constants)
        if name is not None:
            found.append((getattr(node, "lineno", 0), name))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            reads_environ = (
                isinstance(func, ast.Attribute)
                and func.attr in ("get", "pop", "setdefault")
                and _is_environ(func.value)
            )
            if reads_environ or _is_getenv(func):
                note(node, node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            note(node, node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            note(node, node.left)  # `N in os.environ`, `N not in os.environ`
    return found


def test_the_scanner_finds_every_form_of_read() -> None:
    source = """
import os
from os import environ, getenv
PORT = "LORAQ_PORT"
a = os.environ.get("LORAQ_A", "")
b = os.getenv("LORAQ_B")
c = os.environ["LORAQ_C"]
d = "LORAQ_D" in os.environ
e = environ.get(PORT)
f = getenv(f"LORAQ_F_{a}")
g = os.environ.pop("LORAQ_G", None)
os.environ["LORAQ_SET"] = "1"  # a write (for a child process) is not a read
h = os.environ.get("HOME")
# os.environ.get("LORAQ_COMMENT")
"""
    names = [name for _, name in loraq_env_reads(source)]
    assert sorted(names) == ["LORAQ_A", "LORAQ_B", "LORAQ_C", "LORAQ_D", "LORAQ_F_", "LORAQ_G", "LORAQ_PORT"]


def test_only_the_settings_module_reads_loraq_variables() -> None:
    offenders = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == SETTINGS_MODULE:
                continue
            for line, name in loraq_env_reads(path.read_text()):
                if name not in CHILD_PLUMBING:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not offenders, "read it through service.settings.get_settings() instead:\n" + "\n".join(offenders)


def test_the_readme_lists_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(LORAQ_[A-Z0-9_]+)`", section))
    fields = {f"LORAQ_{name.upper()}" for name in Settings.model_fields}
    assert fields - listed == set(), "settings missing from the README's configuration table"
    assert listed - fields == set(), "the README's configuration table lists variables that are no setting"
