"""Builds llmlab's CPU kernels (``llmlab/kernels/csrc/cpu_kernels.cpp``) at install time.

Everything else about the package is in ``pyproject.toml``. The kernels are an optional
extension: on a machine without a C++ compiler the install succeeds without them, and
llmlab falls back to its torch attention backend with a warning
(``llmlab.kernels.cpu_kernels``). The library is plain C++ loaded through ctypes, so the
build needs no torch; the loader uses it only if it was built from the current source with
the current flags (the hash below), and otherwise builds a fresh copy on first use.
"""

import importlib.util
import pathlib

from setuptools import Extension, setup

HERE = pathlib.Path(__file__).resolve().parent

# The loader is standard-library only; import it by path (``import llmlab`` needs torch,
# which an isolated build environment does not have).
_spec = importlib.util.spec_from_file_location(
    "_llmlab_cpu_kernels", HERE / "llmlab" / "kernels" / "cpu_kernels.py"
)
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)

setup(
    ext_modules=[
        Extension(
            # Lands next to the package (llmlab/_cpu_kernels*.so), where the loader looks.
            "llmlab._cpu_kernels",
            sources=["llmlab/kernels/csrc/cpu_kernels.cpp"],
            language="c++",
            define_macros=[("LLMLAB_SOURCE_HASH", f'"{kernels.source_hash()}"')],
            extra_compile_args=list(kernels.COMPILE_FLAGS),
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
