"""The built wheel installs one top-level name, ``flash``: algos/, buffers/, controllers/ and
recipes/ arrive as flash/algos/, ... (their files copied through flash/'s links), recipes with them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ("flash", "algos", "buffers", "controllers", "recipes", "setup.cfg", "pyproject.toml", "README.md")


def test_the_wheel_holds_flash_and_its_four_packages_only(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    for name in TREE:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(
            ROOT / name,
            src / name,
            **({"symlinks": True, "ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}),
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = {n.split("/")[0] for n in names if ".dist-info/" in n}
    assert {n.split("/")[0] for n in names} - dist_info == {"flash"}
    tops = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert [zipfile.ZipFile(wheel).read(t).decode().split() for t in tops] == [["flash"]]
    for folder in ("algos", "buffers", "controllers", "recipes"):
        expected = {
            f"flash/{p.relative_to(ROOT).as_posix()}"
            for p in (ROOT / folder).rglob("*.py")
            if (p.parent / "__init__.py").exists() and "__pycache__" not in p.parts
        }
        assert expected and expected <= set(names), sorted(expected - set(names))[:3]
    assert "flash/recipes/stutter.yaml" in names
