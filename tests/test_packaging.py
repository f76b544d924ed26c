"""jkv installs under names that cannot collide with a user's own `models` or `pallas_kernels`.

The repository keeps its folders (`models/`, `pallas_kernels/`); they install as `jkv_models`
and `jkv_kernels`. Checked from a working directory that holds a `models.py` and a
`pallas_kernels.py` (as a Django app or an ML project would), with the editable install and with
a wheel built by `pip wheel` installed into a fresh virtual environment.
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in the user's directory: the demo model answers, from the installed package's data.
USER_CODE = """
import jkv, jkv_models, jkv_kernels
from pathlib import Path
for mod in (jkv, jkv_models, jkv_kernels):
    assert Path.cwd() not in Path(mod.__file__).parents, mod.__file__
import models, pallas_kernels  # the user's own modules are still theirs
assert models.MINE and pallas_kernels.MINE
params = jkv.load("demo")
out = jkv.generate(params, "The code for Rosa is 1 2 3 4 5 .", max_new_tokens=2)
print(jkv.__file__)
print(len(out.tokens))
"""


def user_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "models.py").write_text("MINE = True\n")
    (project / "pallas_kernels.py").write_text("MINE = True\n")
    return project


def run_user_code(python: str, project: Path) -> list[str]:
    proc = subprocess.run(
        [python, "-c", USER_CODE], cwd=project, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_import_beside_a_users_models_py(tmp_path):
    where, n = run_user_code(sys.executable, user_project(tmp_path))
    assert Path(where).resolve() == ROOT / "jkv" / "__init__.py"
    assert n == "2"


@pytest.mark.slow
def test_wheel_in_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    build = subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("jkv-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # Offline: the dependencies (jax, flax, ...) come from this environment, as a plain path
    # (a path line does not run that folder's .pth files, so its editable jkv stays out).
    fresh_site = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(fresh_site, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where, n = run_user_code(python, user_project(tmp_path))
    assert Path(where).resolve() == Path(fresh_site).resolve() / "jkv" / "__init__.py"
    assert n == "2"
