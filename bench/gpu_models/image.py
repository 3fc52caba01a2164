"""The GPU machine's package set, and an environment here that holds only that set (the dry run).

``device_image.txt`` lists the packages of the GPU machine's image. :func:`make_env` makes a
folder of symbolic links to the installed copies of those packages in this Python (CPU torch
standing in for CUDA torch), so that ``PYTHONPATH=<folder> python -S`` sees what the GPU machine
sees and nothing of batchgen's own dependencies that it lacks. Where a listed package needs
another one here that the list lacks (a local version may depend on more than the device's),
that one is linked too and named in the result, as a stand-in.

    python -m bench.gpu_models.image SITE_PACKAGES   # links; prints the stand-ins

The carried wheels' packages (``wheels.txt``) are left out, stand-ins or not: the dry run
installs those from the wheels, as the GPU check does on the GPU machine.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

IMAGE_LIST = Path(__file__).resolve().parent / "device_image.txt"
WHEEL_LIST = Path(__file__).resolve().parent / "wheels.txt"


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages(path: Path = IMAGE_LIST) -> set[str]:
    """The normalized names listed in ``device_image.txt`` (``#`` lines are comments)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line and not line.startswith("#")}


def carried_packages(path: Path = WHEEL_LIST) -> set[str]:
    """The normalized names of the carried wheels (``wheels.txt``: ``name==version`` lines)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {normalize(line.split("==")[0]) for line in lines if line and not line.startswith("#")}


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The names a distribution requires unconditionally (no extras, markers true here)."""
    from packaging.requirements import Requirement

    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        names.append(normalize(req.name))
    return names


def closure(wanted: set[str], installed: dict[str, metadata.Distribution]) -> tuple[set[str], set[str]]:
    """(the wanted names installed here, the extra names their local requirements add)."""
    present = {n for n in wanted if n in installed}
    seen, todo = set(present), list(present)
    while todo:
        for req in _requirements(installed[todo.pop()]):
            if req in installed and req not in seen:
                seen.add(req)
                todo.append(req)
    return present, seen - present


def _top_level(dist: metadata.Distribution) -> set[str]:
    """The first path components a distribution installed into site-packages."""
    tops = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        tops.add(first)
    return tops


def make_env(target: Path, packages: set[str] | None = None, carried: set[str] = frozenset()
             ) -> dict[str, list[str]]:
    """Link the device's packages (and their local stand-in requirements) into ``target``.

    ``carried`` (normalized names) are never linked, not even as stand-ins: those come from the
    carried wheels, as on the GPU machine.

    Returns ``{"linked": [...], "stand_ins": [...], "absent": [...]}`` (distribution names;
    ``absent``: listed but not installed here, so the dry run goes without them).
    """
    wanted = packages if packages is not None else device_packages()
    installed = {normalize(d.metadata["Name"]): d for d in metadata.distributions()}
    installed = {n: d for n, d in installed.items() if n not in carried}
    present, extra = closure(wanted, installed)
    target.mkdir(parents=True, exist_ok=True)
    for name in sorted(present | extra):
        dist = installed[name]
        root = Path(dist.locate_file(""))
        for top in _top_level(dist):
            link = target / top
            if not link.exists() and (root / top).exists():
                link.symlink_to(root / top)
    return {"linked": sorted(present), "stand_ins": sorted(extra), "absent": sorted(wanted - present)}


if __name__ == "__main__":
    out = make_env(Path(sys.argv[1]), carried=carried_packages())
    print(f"linked {len(out['linked'])} of the device's packages into {sys.argv[1]}; "
          f"local stand-ins: {', '.join(out['stand_ins']) or 'none'}; "
          f"{len(out['absent'])} listed ones are not installed here")
