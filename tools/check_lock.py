"""Checks a dependency lock (constraints.txt) against pyproject.toml; run by `make lock`
and by the test suite. Standard library only: it runs before anything is installed.

    python tools/check_lock.py [LOCK] [--pyproject PATH]

A lock passes when every requirement line pins one exact version (`name==version`), every
dependency pyproject.toml names (runtime, every extra, the build system's) is pinned, torch
is pyproject's version as the CPU build (`2.13.0+cpu`), and nothing would bring a GPU stack
along (triton, NVIDIA's CUDA libraries): packages that declare torch or triton (xgrammar,
for one) can make a resolver fetch a multi-GB CUDA torch. Exit status 1 lists every problem.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Distributions that only a GPU build needs.
FORBIDDEN = re.compile(r"^(triton|pytorch-triton.*|nvidia-.*|cuda-.*)$")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503's normalized project name: `Foo_Bar.baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(text: str) -> tuple[dict[str, str], list[str]]:
    """`{normalized name: version}` of the lock's pins, and the lines that are not one."""
    pins: dict[str, str] = {}
    bad: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip().rstrip("\\").strip()
        if not line or line.startswith("--hash"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;,=<>!~]+)", line)
        if match is None:
            bad.append(raw.strip())
            continue
        pins[normalize(match.group(1))] = match.group(2)
    return pins, bad


def declared(pyproject: dict) -> tuple[set[str], str | None]:
    """Every dependency name pyproject declares, and its torch pin (`==X`), if any."""
    project = pyproject["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    requirements += pyproject.get("build-system", {}).get("requires", [])
    names: set[str] = set()
    torch_pin = None
    for requirement in requirements:
        name = normalize(_NAME.match(requirement).group(1))  # type: ignore[union-attr]
        names.add(name)
        match = re.search(r"==\s*([^\s;,]+)", requirement)
        if name == "torch" and match:
            torch_pin = match.group(1)
    return names, torch_pin


def problems(lock_text: str, pyproject: dict) -> list[str]:
    pins, bad = read_lock(lock_text)
    found = [f"not one exact pin (name==version): {line!r}" for line in bad]
    names, torch_pin = declared(pyproject)
    found += [f"{name} is a dependency in pyproject.toml but has no pin in the lock"
              for name in sorted(names - pins.keys())]
    found += [f"{name}=={pins[name]} would bring a GPU stack: the lock must stay CPU-only"
              for name in sorted(pins) if FORBIDDEN.match(name)]
    if "torch" not in pins:
        found.append("torch has no pin in the lock")
    else:
        want = f"{torch_pin}+cpu" if torch_pin else None
        if not pins["torch"].endswith("+cpu") or (want and pins["torch"] != want):
            found.append(f"torch=={pins['torch']}: the lock must pin the CPU build "
                         f"{want or 'X+cpu'} (pyproject.toml pins torch=={torch_pin})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", nargs="?", default=str(ROOT / "constraints.txt"))
    parser.add_argument("--pyproject", default=str(ROOT / "pyproject.toml"))
    args = parser.parse_args(argv)
    pyproject = tomllib.loads(Path(args.pyproject).read_text())
    found = problems(Path(args.lock).read_text(), pyproject)
    for problem in found:
        print(f"{args.lock}: {problem}", file=sys.stderr)
    if not found:
        print(f"{args.lock}: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
