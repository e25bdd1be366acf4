"""Print the requirements of pyproject.toml (dependencies + one extra), one per line.

The Dockerfile installs these in a layer of their own before it copies the source, so that editing
the code does not reinstall torch and vLLM. `omni-jobs[x]` inside an extra is expanded.
Usage: python3 pyproject-requirements.py EXTRA < pyproject.toml
"""

import re
import sys
import tomllib


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: dict, extra: str) -> list[str]:
    project = pyproject.get("project", {})
    me = norm(project.get("name", ""))
    optional = {norm(k): v for k, v in project.get("optional-dependencies", {}).items()}
    seen: set[str] = set()
    out: list[str] = []

    def add(reqs: list[str]) -> None:
        for req in reqs:
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
            if m and norm(m.group(1)) == me:
                for name in filter(None, (e.strip() for e in (m.group(2) or "").split(","))):
                    group(name)
            else:
                out.append(req)

    def group(name: str) -> None:
        if norm(name) not in seen:
            seen.add(norm(name))
            if norm(name) not in optional:
                sys.exit(f"pyproject.toml has no extra {name!r}")
            add(optional[norm(name)])

    add(project.get("dependencies", []))
    group(extra)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(tomllib.load(sys.stdin.buffer), sys.argv[1])))
