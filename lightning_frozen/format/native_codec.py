"""The CPU kernels of ``codec_kernels.c``: compiled once per machine with the system's C compiler, loaded with ctypes.

They also take the fingerprint's checksum (:func:`checksum16`, for ``base/fingerprint.py``) in one pass.

Why not bitsandbytes on the CPU: measured with ``benchmarks/codec/run.py`` on one core, its CPU ``dequantize_4bit``
decodes NF4 into fp32 at about half, and its ``quantize_4bit`` encodes at about a twentieth, of these kernels' rate
(it is used on CUDA, ``codec.py``). Why not a torch extension: a plain C file builds in about a second with no torch
headers, and ctypes releases the GIL during a call, so threads can split a tensor's blocks between them.

Built with ``-fopenmp`` where the compiler takes it: the library then needs ``libgomp.so.1``, and the loader hands
it the one torch loaded already, so the kernels' ``_all`` variants split a tensor's blocks on the very threads torch
runs its ops on. A decode follows a matmul in every step, and torch's threads spin for a while after each op: a
thread pool of our own competed with them (measured on 2 cores: NF4 decode after a matmul at 1.2-1.7 G weights/s with
two pool threads, 2.9-3.4 G/s on torch's threads). Without OpenMP, a thread pool splits the blocks.

The shared library is cached under ``$LIGHTNING_FROZEN_CACHE`` (default ``~/.cache/lightning_frozen``), named by a
hash of the source, the flags and the compiler, written to a temporary name and renamed, so ranks that build at once
do not see a half-written file. Where no compiler works, :func:`kernels` returns None (once, with a warning) and the
codec uses tensor ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("codec_kernels.c")
# -ffp-contract=off: no fused multiply-adds, so the values are the tensor-op codec's to the bit
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")
OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MIN_BLOCKS_PER_THREAD = 4096  # at least 256K NF4 weights, 1M int8 weights per thread: below that a thread costs more

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "lf_nf4_decode": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "lf_nf4_encode": [_ptr, _int, _i64, _ptr, _i64, _i64, _ptr, _ptr],
    "lf_int8_decode": [_ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "lf_int8_encode": [_ptr, _int, _i64, _i64, _i64, _ptr, _ptr],
    "lf_advise_huge_pages": [_ptr, _i64],
    "lf_checksum16": [_ptr, _int, _i64, _i64, _i64, _i64, _ptr],
    "lf_openmp": [],
}
# the same over the whole tensor, split on the OpenMP threads torch runs its ops on (a build with OpenMP only)
_WHOLE_SIGNATURES = {
    "lf_nf4_decode_all": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "lf_nf4_encode_all": [_ptr, _int, _i64, _ptr, _i64, _i64, _ptr, _ptr],
    "lf_int8_decode_all": [_ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "lf_int8_encode_all": [_ptr, _int, _i64, _i64, _i64, _ptr, _ptr],
    "lf_checksum16_all": [_ptr, _int, _i64, _i64, _i64, _i64, _ptr],
}


def cache_dir() -> Path:
    return Path(os.environ.get("LIGHTNING_FROZEN_CACHE", Path.home() / ".cache" / "lightning_frozen"))


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


@functools.cache
def kernels() -> Optional[ctypes.CDLL]:
    """The loaded kernels, built on first use; None where they cannot be built (a warning says why, once)."""
    compiler = _compiler()
    if compiler is None:
        return _unavailable("no C compiler (cc, gcc or clang) was found")
    # with OpenMP where the compiler has it: torch has loaded its libgomp.so.1 by now, and the loader reuses it
    library, error = _built(compiler, (*FLAGS, "-fopenmp"))
    if library is None:
        library, error = _built(compiler, FLAGS)
    if library is None:
        return _unavailable(error)
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as error:
        return _unavailable(f"{library} does not load ({error})")
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    for name, argtypes in _WHOLE_SIGNATURES.items() if lib.lf_openmp() else ():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def _built(compiler: str, flags: tuple[str, ...]) -> tuple[Optional[Path], str]:
    """The cached library built from SOURCE with ``flags`` (built now if missing), or None and why."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *flags)).encode() + os.uname().machine.encode()).hexdigest()
    library = cache_dir() / f"codec_kernels-{key[:16]}.so"
    if library.exists():
        return library, ""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            return None, f"`{compiler}` failed on {SOURCE.name}: {result.stderr.strip()[-500:]}"
        os.replace(built, library)
    return library, ""


def _unavailable(reason: str) -> None:
    warnings.warn(
        f"lightning-frozen: the CPU codec kernels are not available ({reason}); frozen shards are encoded and decoded"
        " with tensor ops, several times slower. Install a C compiler (e.g. `apt-get install gcc`) to use them.",
        stacklevel=3,
    )
    return None


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lightning-frozen-codec")


def over_blocks(
    blocks: int,
    work: Callable[[int, int], int],
    whole: Optional[Callable[[int], int]] = None,
    min_blocks: int = 0,
) -> int:
    """Run ``work(first, last)`` over ranges of ``blocks`` on up to ``torch.get_num_threads()`` threads, each of at
    least ``min_blocks`` (default :data:`MIN_BLOCKS_PER_THREAD`); return the first nonzero status (a kernel's error),
    else 0. With kernels built with OpenMP, ``whole(min_blocks)`` (the kernel's ``_all`` variant) splits them itself,
    on torch's own threads."""
    lib = kernels()
    min_blocks = min_blocks or MIN_BLOCKS_PER_THREAD
    if whole is not None and lib is not None and lib.lf_openmp():
        return whole(min_blocks)
    threads = max(1, min(torch.get_num_threads(), blocks // min_blocks))
    if threads == 1:
        return work(0, blocks)
    bounds = [blocks * i // threads for i in range(threads + 1)]
    # the calling thread takes the first range: one thread fewer competing with torch's own (which spin a while
    # after each op, e.g. the matmul a gather's decode follows)
    others = _pool(threads - 1).map(work, bounds[1:-1], bounds[2:])
    statuses = [work(bounds[0], bounds[1]), *others]
    return next((status for status in statuses if status), 0)


def empty_output(shape: tuple[int, ...], dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """An uninitialized tensor for decoded values, codes or a gather's bytes. On the CPU its fresh pages are asked to
    be huge ones: the kernel zeroes each 4 KiB page before its first write, about five times slower than it fills a
    2 MiB one, and codes read at every gather spare the TLB (``zero/host_memory.py``)."""
    out = torch.empty(shape, dtype=dtype, device=device or "cpu")
    if out.device.type != "cpu":
        return out
    lib = kernels()
    if lib is not None and out.nbytes >= 4 << 20:
        lib.lf_advise_huge_pages(out.data_ptr(), out.nbytes)
    return out


CHECKSUM_UNIT = 1 << 20  # the kernel's CHECKSUM_UNIT: values a thread's range is counted in
CHECKSUM_MODULUS = (1 << 61) - 1
_CHECKSUM_INPUTS = {torch.float32: (0, 4), torch.bfloat16: (1, 2), torch.float16: (2, 2)}  # code, sums


def checksum16(values: torch.Tensor, start: int) -> Optional[list[int]]:
    """``base/fingerprint.py``'s checksums of ``values`` (flat, from global index ``start``) in one compiled pass:
    ``[plain, weighted]`` of the bf16 then the fp16 cast for fp32 values, of their own bits for bf16 or fp16. None
    where the kernels cannot: no kernels, another dtype or device, a strided tensor, or a NaN (torch's own casts do not
    agree on its pattern)."""
    lib = kernels()
    if lib is None or values.dtype not in _CHECKSUM_INPUTS or values.device.type != "cpu":
        return None
    if not values.is_contiguous():
        return None
    code, count = _CHECKSUM_INPUTS[values.dtype]
    units = max(1, -(-values.numel() // CHECKSUM_UNIT))
    partial = torch.zeros(units, 4, dtype=torch.int64)
    pointer, numel, out = values.data_ptr(), values.numel(), partial.data_ptr()
    status = over_blocks(
        units,
        lambda a, b: lib.lf_checksum16(pointer, code, numel, start, a, b, out + 32 * a),
        lambda m: lib.lf_checksum16_all(pointer, code, numel, start, units, m, out),
        min_blocks=1,
    )
    if status:
        return None
    return [sum(column) % CHECKSUM_MODULUS for column in zip(*partial[:, :count].tolist())]
