"""Where the oneDNN wheels put the library and its headers.

The CPU GEMMs run on oneDNN's matmul (ffi/cpu/onednn_gemm.cc), which comes
from PyPI: `onednn-cpu-gomp` (libdnnl.so.3, GNU OpenMP runtime) at run time,
`onednn-devel-cpu-gomp` (headers) at build time. Their files sit in the
install prefix's lib/ and include/, outside any package, so they are found
through the distributions' file lists. Run as a script, this prints
"include_dir;library" for CMake (empty where the wheels are absent); the
package calls `preload()` before importing the CPU extension, which needs
libdnnl.so.3 wherever pip put it.

Standard library only: CMake runs this file before jax_regemm exists.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as metadata
import os
import pathlib

RUNTIME = "onednn-cpu-gomp"
HEADERS = "onednn-devel-cpu-gomp"
LIBRARY = "libdnnl.so.3"


def _find(dist: str, name: str) -> pathlib.Path | None:
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == name:
            path = pathlib.Path(f.locate()).resolve()
            if path.exists():
                return path
    return None


def library() -> pathlib.Path | None:
    return _find(RUNTIME, LIBRARY)


def preload() -> None:
    """Loads libdnnl.so.3 from the wheel so that the extension's dependency
    resolves by soname. Nothing to do where the wheel is absent: an extension
    built without oneDNN does not need it, one built with it says so on import.

    OpenMP threads wait passively unless the user says otherwise: by default
    GNU OpenMP's threads spin for about a millisecond after each oneDNN call,
    and on a machine with few cores that spinning slows the XLA ops that
    follow (measured on 2 cores: XLA's own 512^3 layer right after ours 1.49 ms
    instead of 0.88; passive waiting costs our call about 0.05 ms). It takes
    effect only if libgomp is not loaded yet, since it reads its environment once."""
    lib = library()
    if lib is not None:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


if __name__ == "__main__":
    header, lib = _find(HEADERS, "dnnl.hpp"), library()
    print(f"{header.parent};{lib}" if header and lib else "")
