"""`pip install --no-build-isolation .` builds the package with the same CMake tree against
the torch already installed, and `import tempo` outside the source tree then loads the op
library from the installed package (here into a --target folder, so the venv is untouched)."""

import os
import subprocess
import sys
from common import ROOT, python_env


def test_pip_install_gives_a_working_package(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (target / "tempo" / "lib" / "libtempo_torch.so").is_file()
    check = (
        "import sys; sys.path.insert(0, %r); import torch, tempo; "
        "assert tempo.library_path().startswith(%r), tempo.library_path(); "
        "x = torch.randn(3, 5, requires_grad=True); tempo.gelu(x).sum().backward(); "
        "print(tempo.__version__)" % (str(target), str(target))
    )
    r = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k != "TEMPO_LIBRARY"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "0.1.0"


def test_a_library_that_cannot_be_used_is_a_clear_import_error(tmp_path):
    """TEMPO_LIBRARY naming no file is an error (it used to fall back to another library
    silently), and a library built against another torch (an undefined torch symbol) says so
    instead of the loader's chain of OSErrors."""
    src = tmp_path / "other_torch.cpp"
    src.write_text(
        "namespace c10 { void a_symbol_this_torch_lacks(); }\n"
        "static int touch = (c10::a_symbol_this_torch_lacks(), 0);\n"
    )
    lib = tmp_path / "libtempo_torch.so"
    r = subprocess.run(["g++", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for path, message in (
        (tmp_path / "missing.so", "TEMPO_LIBRARY=%s is not a file" % (tmp_path / "missing.so")),
        (lib, "%s was built against another torch than this one" % lib),
    ):
        r = subprocess.run(
            [sys.executable, "-c", "import tempo"],
            capture_output=True,
            text=True,
            timeout=300,
            env=python_env(TEMPO_LIBRARY=str(path)),
        )
        assert r.returncode == 1 and ("ImportError: tempo: " + message) in r.stderr.strip().splitlines()[-1], r.stderr
