"""Checks docs/structures.md against the tree: one line per module, each naming files that exist.

    python tools/check_structures.py

Exits non-zero, listing the problems, when a module under vllm/ has no line (package
`__init__.py` files that only import and re-export names are exempt), when a line names a
path that does not exist, when a path has two lines, or when a line has grown into a
paragraph (over MAX_LINE characters).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "structures.md"
MAX_LINE = 200
# A module line: "- `path`: what it owns and what it is for." (several paths joined by " / ").
LINE = re.compile(r"^- ((?:`[^`]+`(?: / )?)+):")


def is_reexport_init(path: Path) -> bool:
    """An `__init__.py` holding only a docstring, imports and `__all__`."""
    if path.name != "__init__.py":
        return False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else ([node.target] if isinstance(node, ast.AnnAssign) else [])
        )
        if targets and all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        return False
    return True


def listed_paths(text: str) -> tuple[list[str], list[str]]:
    """Returns (every path named at the head of a module line, lines over MAX_LINE)."""
    paths: list[str] = []
    long_lines: list[str] = []
    for line in text.splitlines():
        match = LINE.match(line)
        if match is None:
            continue
        paths.extend(re.findall(r"`([^`]+)`", match.group(1)))
        if len(line) > MAX_LINE:
            long_lines.append(line[:80] + "...")
    return paths, long_lines


def main() -> int:
    paths, long_lines = listed_paths(PAGE.read_text())
    seen: dict[str, int] = {}
    for path in paths:
        seen[path] = seen.get(path, 0) + 1
    problems: list[str] = []
    problems += [f"listed twice: {p}" for p, n in seen.items() if n > 1]
    problems += [f"listed but missing: {p}" for p in seen if not (ROOT / p).exists()]
    for module in sorted((ROOT / "vllm").rglob("*.py")):
        name = module.relative_to(ROOT).as_posix()
        if name not in seen and not is_reexport_init(module):
            problems.append(f"not listed: {name}")
    problems += [f"longer than {MAX_LINE} characters: {line}" for line in long_lines]
    for problem in problems:
        print(problem)
    print(f"{PAGE.relative_to(ROOT)}: {len(seen)} paths, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
