"""What the suites share besides the op registry (registry.py), the op table (opinfo.py) and the
tiny model configs (configs.py): the repository's root, the tempo command line and the
environment a subprocess needs to import this tree's package. (The devices a test runs on:
conftest's on_device fixture.)"""

import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The C++ command line (`make check` builds it; TEMPO_BIN names another build's).
BIN = os.environ.get("TEMPO_BIN", os.path.join(ROOT, "build", "tempo"))


def python_env(**extra):
    """os.environ with this tree's package first on PYTHONPATH (a subprocess's `import tempo`)."""
    return dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), **extra)
