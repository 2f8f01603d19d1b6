"""Finding, building and loading llmlab's CPU kernels (``llmlab/kernels/csrc/cpu_kernels.cpp``).

The kernels are plain C++ with OpenMP, called through :mod:`ctypes`: no torch headers, so
a build takes about a second and survives torch upgrades. :func:`load` looks, in order:

1. ``LLMLAB_CPU_KERNELS=0`` in the environment: disabled (the torch path runs).
2. The library ``pip install`` built next to this package (``llmlab/_cpu_kernels*.so``,
   an optional extension in ``setup.py``: an install on a machine without a compiler
   succeeds without it).
3. A build cached under ``$LLMLAB_CACHE_DIR`` (default ``~/.cache/llmlab``)``/kernels``,
   compiled there on first use when 2. is missing or stale (e.g. an editable install whose
   source changed since).

Every library reports the hash of the source it was built from, and only one built from
the current source is used. Builds use ``-march=native``, so the cache key includes the
CPU model and flags. When nothing loads, :func:`unavailable_reason` says why and the CPU
attention backend falls back to the torch path with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

KERNELS_DIR = pathlib.Path(__file__).resolve().parent
SOURCE = KERNELS_DIR / "csrc" / "cpu_kernels.cpp"
# Where ``pip install`` puts its build (the extension ``llmlab._cpu_kernels`` in setup.py):
# the ``llmlab`` package folder, one above this one.
PACKAGE_DIR = KERNELS_DIR.parent

# -march=native: the build runs where it will be used (install time or first use).
# -fno-math-errno / -fno-trapping-math let sqrt and friends vectorise without the rest of
# -ffast-math (which would assume no infinities, and the softmax masks with -inf).
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=c++17",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-mprefer-vector-width=512",
)


def source_hash(source: pathlib.Path = SOURCE) -> str:
    """The first 16 hex digits of the SHA-256 of the source and the compile flags: what a
    matching build reports."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join(COMPILE_FLAGS).encode())
    return digest.hexdigest()[:16]


def machine_tag() -> str:
    """A short digest of the CPU model and flags (builds are ``-march=native``; the
    simulator's saved measurement of this machine is keyed by it too)."""
    text = platform.machine()
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        text += "".join(sorted(set(lines)))
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def cache_root() -> pathlib.Path:
    """Where llmlab keeps what it builds or measures once: ``$LLMLAB_CACHE_DIR``, default
    ``~/.cache/llmlab``."""
    return pathlib.Path(os.environ.get("LLMLAB_CACHE_DIR")
                        or pathlib.Path.home() / ".cache" / "llmlab")


def cache_dir() -> pathlib.Path:
    return cache_root() / "kernels"


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``c++``, ``g++`` or ``clang++``."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build(output: pathlib.Path, cxx: str | None = None) -> pathlib.Path:
    """Compile the kernels into the shared library ``output`` (atomically: a concurrent
    loader never sees half a file). Raises ``RuntimeError`` with the compiler's output."""
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=output.parent)
    os.close(fd)
    command = [
        cxx,
        *COMPILE_FLAGS,
        "-shared",
        f'-DLLMLAB_SOURCE_HASH="{source_hash()}"',
        str(SOURCE),
        "-o",
        tmp,
    ]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(
                f"building the CPU kernels failed ({' '.join(command)}):\n{done.stderr[-2000:]}"
            )
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


class _Step(ctypes.Structure):
    """Mirrors ``Step`` in cpu_kernels.cpp: one step's batch, shared by every layer."""

    _fields_ = [
        ("query_start", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("items", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("num_items", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_threads", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    """Mirrors ``Layer`` in cpu_kernels.cpp: one layer's tensors (element strides)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_token_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("k_token_stride", ctypes.c_int64),
        ("k_head_stride", ctypes.c_int64),
        ("v", ctypes.c_void_p),
        ("v_token_stride", ctypes.c_int64),
        ("v_head_stride", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("cache_head_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("sliding_window", ctypes.c_int64),
    ]


class CpuKernels:
    """The loaded library, with typed entry points."""

    Step = _Step
    Layer = _Layer

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.llmlab_source_hash.restype = ctypes.c_char_p
        lib.llmlab_tile_q.restype = ctypes.c_int64
        fn = lib.llmlab_paged_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Step), ctypes.POINTER(_Layer)]
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        # The fused elementwise ops (llmlab.kernels.fused): dtype code, pointers, sizes.
        signatures = {
            "add_rms_norm": [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, f32, i64],
            "silu_and_mul": [ctypes.c_int, ptr, ptr, i64, i64, i64],
            "rotary": [ctypes.c_int, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64],
        }
        # Greedy sampling (llmlab.sampling.greedy.argmax_logprob): float32 logits only.
        lib.llmlab_argmax_logprob.restype = None
        lib.llmlab_argmax_logprob.argtypes = [ptr, i64, i64, ptr, ptr, i64]
        self.argmax_logprob = lib.llmlab_argmax_logprob
        for name, argtypes in signatures.items():
            op = getattr(lib, f"llmlab_{name}")
            op.restype = ctypes.c_int
            op.argtypes = argtypes
            setattr(self, name, op)
        self._lib = lib
        self.built_from = lib.llmlab_source_hash().decode()
        self.tile_q = int(lib.llmlab_tile_q())
        self.paged_attention = fn


def _prebuilt() -> list[pathlib.Path]:
    return sorted(PACKAGE_DIR.glob("_cpu_kernels*.so"))


@functools.lru_cache(maxsize=1)
def _load() -> tuple[CpuKernels | None, str | None]:
    if os.environ.get("LLMLAB_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "disabled by LLMLAB_CPU_KERNELS"
    if not SOURCE.exists():
        return None, f"the kernel source {SOURCE} is missing from this install"
    wanted = source_hash()
    for path in _prebuilt():
        try:
            kernels = CpuKernels(path)
        except OSError:
            continue
        if kernels.built_from == wanted:
            return kernels, None
    cached = cache_dir() / f"cpu_kernels-{wanted}-{machine_tag()}.so"
    try:
        if not cached.exists():
            build(cached)
        kernels = CpuKernels(cached)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"{type(err).__name__}: {err}"
    if kernels.built_from != wanted:  # a foreign file under our name
        return None, f"{cached} was built from another source ({kernels.built_from})"
    return kernels, None


def load() -> CpuKernels | None:
    """The CPU kernels, built on first use if needed; None where they cannot load."""
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why :func:`load` returns None (None when the kernels are available)."""
    return _load()[1]
