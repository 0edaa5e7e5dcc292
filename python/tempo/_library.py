"""Finds and loads libtempo_torch.so, which registers the ``tempo`` op namespace."""

import os
from pathlib import Path

import torch

_NAME = "libtempo_torch.so"
_loaded = None


def _candidates():
    env = os.environ.get("TEMPO_LIBRARY")
    if env:
        if not Path(env).is_file():  # named by the user: not silently replaced by another
            raise ImportError(
                "tempo: TEMPO_LIBRARY=%s is not a file (unset it to use the library built with the package)" % env
            )
        yield Path(env)
    here = Path(__file__).resolve().parent
    yield here / "lib" / _NAME  # an installed package (pip install .)
    yield here.parent.parent / "build" / "lib" / _NAME  # the source tree after `make`


def library_path():
    """Path of the loaded op library."""
    return _loaded


def load_library():
    global _loaded
    if _loaded is not None:
        return _loaded
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            try:
                torch.ops.load_library(str(path))
            except OSError as e:
                if "undefined symbol" not in str(e.__cause__ or e):
                    raise
                raise ImportError(
                    "tempo: %s was built against another torch than this one (%s): rebuild it with `make` (or "
                    "`pip install --no-build-isolation .`) in this environment" % (path, torch.__version__)
                ) from e
            _loaded = str(path)
            return _loaded
    raise ImportError(
        "tempo: cannot find %s (looked in: %s). Build it with `make run` or set TEMPO_LIBRARY."
        % (_NAME, ", ".join(tried))
    )
