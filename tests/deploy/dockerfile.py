"""A small Dockerfile reader for the structural checks: instructions with continuations joined,
build ARG defaults substituted into FROM lines, and stages split at each FROM."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper-case: FROM, RUN, USER, ...
    args: str
    line: int  # 1-based line where the instruction starts


@dataclass
class Stage:
    image: str  # the FROM reference with global ARG defaults substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def instructions(text: str) -> list[Instruction]:
    """Join `\\` continuations and skip comments and heredoc bodies (`<<'EOF' ... EOF`)."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i
        raw = lines[i].strip()
        i += 1
        if not raw or raw.startswith("#"):
            continue
        parts = [raw]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1]
            nxt = lines[i].strip()
            i += 1
            if nxt and not nxt.startswith("#"):
                parts.append(nxt)
        joined = " ".join(parts)
        heredoc = re.search(r"<<-?['\"]?(\w+)['\"]?", joined)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start + 1))
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions(path.read_text()):
        if ins.keyword == "ARG" and not stages:
            arg, _, default = ins.args.partition("=")
            global_args[arg] = default.strip('"')
        elif ins.keyword == "FROM":
            tokens = [t for t in ins.args.split() if not t.startswith("--")]
            stage_name = tokens[2] if len(tokens) >= 3 and tokens[1].upper() == "AS" else None
            stages.append(Stage(substitute(tokens[0], global_args), stage_name))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            raise ValueError(f"{path}:{ins.line}: {ins.keyword} before the first FROM")
    return Dockerfile(path, global_args, stages)
