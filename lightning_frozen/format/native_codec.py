"""The CPU kernels of ``codec_kernels.c``: built once per CPU target with the system's C compiler, loaded with ctypes.
:data:`KERNELS` runs the codec's passes with them (``codec.Kernels``), and the fingerprint's checksum in one pass
(:func:`checksum16`, for ``base/fingerprint.py``); ``zero/frozen_compute.py`` hands it to the core, which otherwise
runs tensor ops. Built with OpenMP where the compiler takes it, on the threads torch already runs (a pool of our own
competed with them after every matmul); where no compiler works, :func:`kernels` returns None with one warning. Where
the library is cached and why not bitsandbytes on the CPU: docs/frozen-storage.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

from lightning_frozen import process
from lightning_frozen.format.codec import BlockFormat, nf4_bounds, nf4_table, split

SOURCE = Path(__file__).with_name("codec_kernels.c")
# -ffp-contract=off: no fused multiply-adds, so the values are the tensor-op codec's to the bit
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")
OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# a build takes about half a second; ranks building at once on a loaded node take longer, a hung compiler forever
COMPILE_TIMEOUT_S = 120.0
MIN_BLOCKS_PER_THREAD = 4096  # at least 256K NF4 weights, 1M int8 weights per thread: below that a thread costs more
# a layer's tile is one range, decoded between two matmuls on the same threads: split it finer (docs/internals.md)
RANGE_MIN_BLOCKS_PER_THREAD = 1024
# a thread's tile in a matmul from codes (rows, columns: 512 KiB of fp32); docs/internals.md, "Tuned constants"
MATMUL_TILE = (128, 1024)

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
# a matmul from codes: sgemm, nf4, codes, scales, table, shard numel, offset, M, N, K, input, output, tile rows and
# columns, buffers, threads
_MATMUL_SIGNATURE = [_ptr, _int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _int]
# the same over the whole tensor, split on the OpenMP threads torch runs its ops on (a build with OpenMP only)
_WHOLE_SIGNATURES = {
    "lf_nf4_decode_all": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "lf_nf4_encode_all": [_ptr, _int, _i64, _ptr, _i64, _i64, _ptr, _ptr],
    "lf_int8_decode_all": [_ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "lf_int8_encode_all": [_ptr, _int, _i64, _i64, _i64, _ptr, _ptr],
    "lf_checksum16_all": [_ptr, _int, _i64, _i64, _i64, _i64, _ptr],
    # a sleeping team that makes libgomp's waiting threads spin briefly (zero/compute/waiting_threads.py)
    "lf_openmp_hold": [],
    "lf_openmp_park": [_int],
    "lf_openmp_release": [],
    # a frozen linear layer's matmul from its codes, forward and backward (zero/compute/coded_linear.py)
    "lf_coded_matmul": _MATMUL_SIGNATURE,
    "lf_coded_matmul_grad": _MATMUL_SIGNATURE,
}


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
    try:
        with _library_dir() as directory:
            lib = _loaded(compiler, directory)
    except subprocess.TimeoutExpired as error:
        return _unavailable(f"`{' '.join(error.cmd)}` did not finish in {error.timeout:g} s")
    except subprocess.CalledProcessError as error:
        return _unavailable(f"`{' '.join(error.cmd)}` failed: {error.stderr.strip()[-500:]}")
    except OSError as error:
        return _unavailable(str(error))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    for name, argtypes in _WHOLE_SIGNATURES.items() if lib.lf_openmp() else ():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def _loaded(compiler: str, directory: Path) -> ctypes.CDLL:
    """The kernels built by ``compiler`` for this CPU, from ``directory`` (built there now if missing)."""
    target = _build_target(compiler)
    # with OpenMP where the compiler has it: torch has loaded its libgomp.so.1 by now, and the loader reuses it
    try:
        library = _built(compiler, target, directory, (*FLAGS, "-fopenmp"))
    except subprocess.CalledProcessError:
        library = _built(compiler, target, directory, FLAGS)
    return ctypes.CDLL(str(library))


def _build_target(compiler: str) -> str:
    """What ``-march=native`` builds for with ``compiler`` here: its dry run names its version and every ISA flag."""
    # in the library's key: a home shared by nodes of several CPU generations then holds one library per ISA, simpler
    # than a baseline build that picks its kernels at run time, and -O3 still vectorizes for the node's own ISA
    return _run_compiler([compiler, "-march=native", "-###", "-E", "-x", "c", os.devnull]).stderr


def _built(compiler: str, target: str, directory: Path, flags: tuple[str, ...]) -> Path:
    """The library built from SOURCE with ``flags`` in ``directory`` (built now if missing or if others could write
    it). Raises ``subprocess.CalledProcessError`` where the compiler fails, ``TimeoutExpired`` where it hangs."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *flags, target)).encode()).hexdigest()
    library = directory / f"codec_kernels-{key[:16]}.so"
    if library.exists() and not _refused(library):
        return library
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / library.name
        _run_compiler([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"]).check_returncode()
        built.chmod(0o700)  # whatever the umask: a library the group could write would be refused next time
        os.replace(built, library)
    return library


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess[str]:
    """``command``'s output; raises ``subprocess.TimeoutExpired`` after :data:`COMPILE_TIMEOUT_S`."""
    # a session of its own, so that a timeout kills cc1, as and ld too: they would hold the output pipes open
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=COMPILE_TIMEOUT_S)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@contextlib.contextmanager
def _library_dir() -> Iterator[Path]:
    """The first of :func:`process.cache_dirs` that is usable, else a private temporary directory, removed on exit (a
    library loaded from it stays mapped)."""
    directory = next((directory for directory in process.cache_dirs() if _usable(directory)), None)
    if directory is not None:
        yield directory
        return
    warnings.warn(
        "lightning-frozen: no cache directory for the CPU codec kernels can be written"
        f" ({_named(process.cache_dirs())}); they are built in a private temporary directory and removed once loaded,"
        " so every process builds them again. Set LIGHTNING_FROZEN_CACHE to a directory only you can write to keep"
        " them.",
        stacklevel=3,  # kernels(), past contextlib's __enter__
    )
    with tempfile.TemporaryDirectory(prefix="lightning_frozen-") as scratch:
        yield Path(scratch)


def _usable(directory: Path) -> bool:
    """Whether ``directory`` is one that this user can write and no other can (made now if missing)."""
    with contextlib.suppress(OSError):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    # by the effective ids, which are the ones that write: access() by the real uid drops the process's capabilities
    writable = directory.is_dir() and os.access(directory, os.W_OK | os.X_OK, effective_ids=True)
    return writable and not _refused(directory)


def _refused(path: Path) -> bool:
    """Whether another user could write ``path`` (a warning names it and the fix): its library is not loaded."""
    status = path.stat()
    if status.st_uid != os.geteuid():
        why, fix = f"it is owned by uid {status.st_uid}", f"`chown {os.geteuid()}`"
    elif status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why, fix = f"its mode {stat.S_IMODE(status.st_mode):o} lets other users write it", "`chmod go-w`"
    else:
        return False
    warnings.warn(
        f"lightning-frozen: not loading the CPU codec kernels from {path}: {why}, and a library there is code this"
        f" process would run. They are built in a private place instead; {fix} it, or set LIGHTNING_FROZEN_CACHE to a"
        " directory only you can write.",
        stacklevel=2,
    )
    return True


def _named(dirs: list[Path]) -> str:
    return ", ".join(map(str, dirs)) or "HOME, XDG_CACHE_HOME and LIGHTNING_FROZEN_CACHE are unset"


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
    2 MiB one, and codes read at every gather spare the TLB (``zero/compute/host_memory.py``)."""
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


def encode_blocks(flat: torch.Tensor, fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor) -> Optional[int]:
    """``codec.Kernels.encode`` with the compiled kernels: None unless ``flat`` is a contiguous fp32 or bf16 tensor in
    CPU memory and the kernels built."""
    lib = kernels()
    if lib is None or flat.device.type != "cpu" or flat.dtype not in (torch.float32, torch.bfloat16):
        return None
    flat = flat.contiguous()
    source, bf16, count, blocks = flat.data_ptr(), int(flat.dtype == torch.bfloat16), flat.numel(), scales.numel()
    out = (codes.data_ptr(), scales.data_ptr())
    if fmt.name == "int8":
        return over_blocks(
            blocks,
            lambda a, b: lib.lf_int8_encode(source, bf16, count, a, b, *out),
            lambda m: lib.lf_int8_encode_all(source, bf16, count, blocks, m, *out),
        )
    bounds = nf4_bounds(torch.device("cpu"))
    return over_blocks(
        blocks,
        lambda a, b: lib.lf_nf4_encode(source, bf16, count, bounds.data_ptr(), a, b, *out),
        lambda m: lib.lf_nf4_encode_all(source, bf16, count, bounds.data_ptr(), blocks, m, *out),
    )


def decode_blocks(codes: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat, out: torch.Tensor) -> bool:
    """``codec.Kernels.decode`` with the compiled kernels: the first ``numel`` values of int8 or NF4 ``codes`` and their
    block ``scales`` into ``out`` (contiguous, in one of :data:`OUT_DTYPES`); False where they cannot (no kernels,
    another device or dtype)."""
    lib = kernels()
    if lib is None or codes.device.type != "cpu" or out.dtype not in OUT_DTYPES:
        return False
    blocks, dtype_code = fmt.blocks(numel), OUT_DTYPES[out.dtype]
    source, scale_ptr, target = codes.data_ptr(), scales.contiguous().data_ptr(), out.data_ptr()
    if fmt.name == "int8":
        over_blocks(
            blocks,
            lambda a, b: lib.lf_int8_decode(source, scale_ptr, a, b, numel, target, dtype_code),
            lambda m: lib.lf_int8_decode_all(source, scale_ptr, blocks, m, numel, target, dtype_code),
        )
        return True
    table = nf4_table(torch.device("cpu"))
    over_blocks(
        blocks,
        lambda a, b: lib.lf_nf4_decode(source, scale_ptr, table.data_ptr(), a, b, numel, target, dtype_code),
        lambda m: lib.lf_nf4_decode_all(source, scale_ptr, table.data_ptr(), blocks, m, numel, target, dtype_code),
    )
    return True


def range_decoder(rows: torch.Tensor, numel: int, fmt: BlockFormat) -> Optional[Callable[[int, torch.Tensor], bool]]:
    """For the many small ranges decoded from one gather (``rows``: one int8 or NF4 shard of ``numel`` values a row),
    its codes split once: a function that decodes ``out.numel()`` values from flat index ``start`` into ``out``
    (contiguous, on the CPU, in one of :data:`OUT_DTYPES`) and returns True, or returns False having written nothing
    where the range does not start on a block or runs past its row. None without the kernels or OpenMP."""
    lib = kernels()
    if lib is None or not lib.lf_openmp() or rows.device.type != "cpu" or fmt.cast_dtype is not None:
        return None
    # the tensors beside their addresses: the scales may be a copy that nothing else holds
    shards = [
        (codes, scales, codes.data_ptr(), scales.data_ptr())
        for codes, scales in map(split, rows, [fmt.name] * len(rows))
    ]
    code_bytes, scale_bytes, size = fmt.code_bytes_per_block, fmt.scale_bytes, fmt.block_size
    table = nf4_table(torch.device("cpu"))
    nf4 = fmt.name == "nf4"

    def decode(start: int, out: torch.Tensor) -> bool:
        row, first = divmod(start, numel)
        count = out.numel()
        if first % size or first + count > numel or out.dtype not in OUT_DTYPES or not out.is_contiguous():
            return False
        block = first // size
        _, _, codes, scales = shards[row]
        codes, scales, blocks = codes + block * code_bytes, scales + block * scale_bytes, -(-count // size)
        dtype_code, target = OUT_DTYPES[out.dtype], out.data_ptr()
        if nf4:
            lib.lf_nf4_decode_all(
                codes, scales, table.data_ptr(), blocks, RANGE_MIN_BLOCKS_PER_THREAD, count, target, dtype_code
            )
        else:
            lib.lf_int8_decode_all(codes, scales, blocks, RANGE_MIN_BLOCKS_PER_THREAD, count, target, dtype_code)
        return True

    return decode


@functools.cache
def blas_sgemm() -> Optional[int]:
    """The address of torch's own fp32 BLAS matmul (``sgemm_`` of MKL, linked into ``libtorch_cpu``) for
    :class:`CodedMatmuls`, which call it with 32-bit integers on each thread of an OpenMP region of torch's libgomp,
    where MKL runs on that one thread. None where the kernels have no OpenMP or torch no MKL, and, with one warning,
    where that call would go wrong: another OpenMP runtime in the process (MKL would not see the region and start a
    team in each thread), or an ``sgemm_`` that reads 64-bit integers (ILP64)."""
    lib = kernels()
    sgemm = _torch_sgemm() if lib is not None and lib.lf_openmp() else None
    if sgemm is None:
        return None
    if not torchs_libgomp_alone():
        runtimes = ", ".join(openmp_runtimes()) or "none that /proc/self/maps shows"
        why = f"this process runs the OpenMP runtimes {runtimes}, not torch's libgomp alone"
    elif not _reads_32bit_integers(sgemm):
        why = "torch's sgemm_ reads 64-bit integers (an ILP64 BLAS) where the kernels pass 32-bit ones"
    else:
        return sgemm
    warnings.warn(f"lightning-frozen: frozen layers multiply row tiles, not matmuls from codes: {why}.", stacklevel=2)
    return None


def _torch_sgemm() -> Optional[int]:
    """The address of the ``sgemm_`` that ``libtorch_cpu`` exports where torch was built with MKL, else None."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(library.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _reads_32bit_integers(sgemm: int) -> bool:
    """Whether ``sgemm`` reads its integers as 32 bits (LP64): a 1 x 1 x 1 product whose integers are followed by 32
    bits of ones, which a 64-bit reading takes for negative sizes (it then computes nothing and prints one line)."""
    one, ref = (ctypes.c_int32 * 2)(1, -1), ctypes.byref
    alpha, a, b, beta, out = (ctypes.c_float(value) for value in (1.0, 2.0, 3.0, 0.0, 0.0))
    call = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 13)(sgemm)
    call(b"N", b"N", one, one, one, ref(alpha), ref(a), one, ref(b), one, ref(beta), ref(out), one)
    return out.value == 6.0


def openmp_runtimes() -> list[str]:
    """The files of the OpenMP runtimes mapped into this process (libgomp, libiomp, libomp), from ``/proc/self/maps``;
    empty where it cannot be read. (threadpoolctl lists the same by file name, a new dependency for these few lines.)"""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    paths = {field[5].strip() for field in fields if len(field) == 6}
    return sorted(path for path in paths if Path(path).name.startswith(("libgomp", "libiomp", "libomp")))


def torchs_libgomp_alone() -> bool:
    """Whether one OpenMP runtime runs in this process and it is GNU's libgomp (torch's wheels): the kernels then run
    on torch's threads (they load the ``libgomp.so.1`` torch brought) and so does MKL inside torch."""
    runtimes = openmp_runtimes()
    return len(runtimes) == 1 and Path(runtimes[0]).name.startswith("libgomp")


class CodedMatmuls:
    """A frozen ``out_features x in_features`` weight's matmuls straight from its gathered codes (``rows``: one int8 or
    NF4 shard of ``numel`` values each), its codes split once: each OpenMP thread decodes a tile of the weight
    (:data:`MATMUL_TILE`) into a buffer of its own and multiplies it with torch's BLAS on that thread while it is in
    the thread's cache. Build with :meth:`of`, which says where it cannot."""

    def __init__(self, lib: ctypes.CDLL, sgemm: int, rows: torch.Tensor, numel: int, fmt: BlockFormat) -> None:
        self._lib, self._sgemm, self._nf4 = lib, sgemm, int(fmt.name == "nf4")
        self._block, self._numel = fmt.block_size, numel
        self._shards = [split(row, fmt.name) for row in rows]  # the tensors beside their addresses below
        self._codes = (ctypes.c_void_p * len(rows))(*(codes.data_ptr() for codes, _ in self._shards))
        self._scales = (ctypes.c_void_p * len(rows))(*(scales.data_ptr() for _, scales in self._shards))
        self._table = nf4_table(torch.device("cpu"))

    @classmethod
    def of(cls, rows: torch.Tensor, numel: int, fmt: BlockFormat) -> Optional[CodedMatmuls]:
        """The matmuls of ``rows`` (see the class), or None: no kernels, OpenMP or BLAS, a cast format, or shards that
        do not end on a block."""
        lib = kernels()
        sgemm = blas_sgemm() if lib is not None and lib.lf_openmp() else None
        if sgemm is None or fmt.cast_dtype is not None or rows.device.type != "cpu" or numel % fmt.block_size:
            return None
        return cls(lib, sgemm, rows, numel, fmt)

    def fits(self, offset: int, shape: tuple[int, int], values: torch.Tensor) -> bool:
        """Whether the weight of ``shape`` at flat index ``offset`` can multiply fp32 ``values``: its rows and offset
        on whole blocks, within the shards."""
        out_features, in_features = shape
        return (
            values.dtype == torch.float32
            and values.device.type == "cpu"
            and in_features % self._block == 0
            and offset % self._block == 0
            and offset + out_features * in_features <= self._numel * len(self._shards)
            and 0 < values.shape[0] < 2**31
            and out_features * in_features < 2**31
        )

    def _tile(self, shape: tuple[int, int], split_rows: bool) -> tuple[int, int, torch.Tensor, int]:
        """A thread's tile (rows, columns) and every thread's buffer: :data:`MATMUL_TILE`, smaller in the dimension the
        threads split (the weight's rows forward, its columns backward) where it would leave a thread idle."""
        threads = torch.get_num_threads()
        rows, columns = MATMUL_TILE
        if split_rows:
            rows = min(rows, max(16, -(-shape[0] // threads)))
        else:
            share = -(-shape[1] // threads)
            columns = min(columns, -(-share // self._block) * self._block)
        columns = min(shape[1], max(self._block, columns // self._block * self._block))
        return rows, columns, torch.empty(threads * rows * columns, dtype=torch.float32), threads

    def forward(
        self, offset: int, shape: tuple[int, int], values: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``values @ weight.T`` (``values``: 2-D, contiguous, fp32, :meth:`fits`), into ``out`` where given
        (contiguous)."""
        out = values.new_empty(values.shape[0], shape[0]) if out is None else out
        return self._run(self._lib.lf_coded_matmul, offset, shape, values, out, split_rows=True)

    def backward(
        self, offset: int, shape: tuple[int, int], grad: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``grad @ weight`` (``grad``: 2-D, contiguous, fp32, :meth:`fits`), into ``out`` where given (contiguous)."""
        out = grad.new_empty(grad.shape[0], shape[1]) if out is None else out
        return self._run(self._lib.lf_coded_matmul_grad, offset, shape, grad, out, split_rows=False)

    def _run(
        self,
        kernel: Callable[..., int],
        offset: int,
        shape: tuple[int, int],
        values: torch.Tensor,
        out: torch.Tensor,
        split_rows: bool,
    ) -> torch.Tensor:
        rows, columns, buffers, threads = self._tile(shape, split_rows)
        kernel(
            *(self._sgemm, self._nf4, self._codes, self._scales, self._table.data_ptr(), self._numel, offset),
            *(values.shape[0], *shape, values.data_ptr(), out.data_ptr(), rows, columns, buffers.data_ptr(), threads),
        )
        return out


# the compiled passes as the core takes them (``codec.Kernels``, ``fingerprint.Checksummer``)
KERNELS = SimpleNamespace(empty=empty_output, encode=encode_blocks, decode=decode_blocks, checksum=checksum16)
