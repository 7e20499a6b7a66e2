"""Where the CPU codec kernels are built and cached (``format/native_codec.py``, issue 36): on the machines users have
(a read-only HOME, no HOME at all, a home shared by CPUs of several generations or writable by others, a compiler that
hangs), a library is loaded only if it was built for this CPU and no other user could have written it; else it is built
again in a private place, or the codec uses tensor ops. Never a crash."""

from __future__ import annotations

import ctypes.util
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_frozen.format import native_codec

UNKNOWN_UID = 54321  # a uid with no account, as OpenShift runs pods
# loads the kernels through the fingerprint's checksum, as a run does, and reports what it saw
LOAD_SCRIPT = """
import json, warnings
import torch
from lightning_frozen.format import native_codec
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    checksum = native_codec.checksum16(torch.arange(4096, dtype=torch.float32), 0)
library = getattr(native_codec.kernels(), "_name", None)
print(json.dumps({"checksum": checksum, "library": library, "warnings": [str(w.message) for w in caught]}))
"""


def _load_in_subprocess(prefix: list[str], env: dict[str, str]) -> dict:
    """What LOAD_SCRIPT reports, run under ``prefix`` with ``env`` and PATH only (no HOME unless ``env`` has one)."""
    command = [*prefix, sys.executable, "-c", LOAD_SCRIPT]
    result = subprocess.run(
        command, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def _read_only(path: Path) -> list[str]:
    """A command prefix under which ``path`` cannot be written, by this user either."""
    if os.getuid() != 0:
        path.chmod(0o555)
        return []
    # root writes through file modes: a read-only bind mount, in a mount namespace of the command's own
    if not shutil.which("unshare") or subprocess.run(["unshare", "--mount", "true"]).returncode:
        pytest.skip("root needs `unshare --mount` to make a read-only directory")
    remount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", remount, str(path)]


def _as_unknown_uid() -> list[str]:
    """A command prefix that runs as :data:`UNKNOWN_UID`, still able to read everything (the interpreter may live
    in root's home), writing as that uid."""
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as a uid with no account")
    if UNKNOWN_UID in {entry.pw_uid for entry in pwd.getpwall()}:
        pytest.skip(f"uid {UNKNOWN_UID} has an account here")
    caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return ["setpriv", f"--reuid={UNKNOWN_UID}", f"--regid={UNKNOWN_UID}", "--clear-groups", *caps]


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """``kernels()`` found again in the test, and again after it (in the environment the other tests run in)."""
    native_codec.kernels.cache_clear()
    yield
    native_codec.kernels.cache_clear()


@pytest.fixture(scope="module")
def built_library(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The kernels built once into ``<xdg>/lightning_frozen``, ``<xdg>`` a private ``XDG_CACHE_HOME``."""
    xdg = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LIGHTNING_FROZEN_CACHE", raising=False)
        patch.setenv("XDG_CACHE_HOME", str(xdg))
        native_codec.kernels.cache_clear()
        lib = native_codec.kernels()
        native_codec.kernels.cache_clear()
    if lib is None:
        pytest.skip("no C compiler builds the kernels here")
    yield Path(lib._name)


def test_a_read_only_home_builds_the_kernels_in_a_private_temporary_directory(tmp_path: Path) -> None:
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    scratch.mkdir()
    report = _load_in_subprocess(_read_only(home), {"HOME": str(home), "TMPDIR": str(scratch)})
    assert report["checksum"] is not None and report["library"].startswith(str(scratch))
    tried = str(home / ".cache" / "lightning_frozen")
    assert any("no cache directory" in w and tried in w for w in report["warnings"]), report["warnings"]
    assert not list(scratch.glob("lightning_frozen-*")) and not list(home.iterdir())  # the temporary directory is gone


@pytest.mark.parametrize("cache_set", [True, False], ids=["LIGHTNING_FROZEN_CACHE", "nothing-set"])
def test_without_home_under_a_uid_with_no_account_the_kernels_build(tmp_path: Path, cache_set: bool) -> None:
    prefix = _as_unknown_uid()
    writable = tmp_path / "writable"
    writable.mkdir()
    os.chown(writable, UNKNOWN_UID, UNKNOWN_UID)
    cache = writable / "cache"
    env = {"TMPDIR": str(writable), **({"LIGHTNING_FROZEN_CACHE": str(cache)} if cache_set else {})}
    report = _load_in_subprocess(prefix, env)
    assert report["checksum"] is not None
    if cache_set:
        assert Path(report["library"]).parent == cache and not report["warnings"]
    else:
        assert any("HOME, XDG_CACHE_HOME and LIGHTNING_FROZEN_CACHE are unset" in w for w in report["warnings"])


def test_a_library_built_for_another_cpu_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    system_compiler = shutil.which("cc") or shutil.which("gcc")
    if system_compiler is None:
        pytest.skip("no C compiler")
    compiler, cache = tmp_path / "cc", tmp_path / "cache"
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("LIGHTNING_FROZEN_CACHE", str(cache))
    loaded = []
    # one compiler on a shared home: on a node whose CPU has no AVX2, then on this one
    for node_flags in ("-mno-avx2", ""):
        compiler.write_text(f'#!/bin/sh\nexec {system_compiler} "$@" {node_flags}\n')
        compiler.chmod(0o755)
        native_codec.kernels.cache_clear()
        loaded.append(native_codec.kernels()._name)
    assert loaded[0] != loaded[1] and sorted(map(str, cache.iterdir())) == sorted(loaded)


@pytest.mark.parametrize("others", ["group-writable", "world-writable", "owned by another uid"])
def test_a_library_in_a_directory_other_users_can_write_is_refused(
    others: str, built_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy2(built_library, shared / built_library.name)  # what kernels() would load as it is
    if others == "owned by another uid":
        if os.getuid() != 0:
            pytest.skip("only root gives a directory away")
        os.chown(shared, UNKNOWN_UID, -1)
    else:
        shared.chmod(0o770 if others == "group-writable" else 0o1777)
    monkeypatch.setenv("LIGHTNING_FROZEN_CACHE", str(shared))
    monkeypatch.setenv("XDG_CACHE_HOME", str(built_library.parent.parent))  # the private place, already built
    why = "owned by uid" if others == "owned by another uid" else "lets other users write it"
    with pytest.warns(UserWarning, match=f"not loading the CPU codec kernels from {re.escape(str(shared))}: .*{why}"):
        assert native_codec.kernels()._name == str(built_library)


def test_a_library_file_other_users_can_write_is_built_again(
    built_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    library = cache / built_library.name
    shutil.copy(built_library, library)
    library.chmod(0o666)
    monkeypatch.setenv("LIGHTNING_FROZEN_CACHE", str(cache))
    with pytest.warns(UserWarning, match=f"from {re.escape(str(library))}: its mode 666"):
        assert native_codec.kernels()._name == str(library)
    assert stat.S_IMODE(library.stat().st_mode) == 0o700 and list(cache.iterdir()) == [library]


@pytest.mark.parametrize(
    "compiler_body, reason",
    [("sleep 60", "did not finish in 0.5 s"), ("echo 'cc1: internal compiler error' >&2; exit 1", "internal compiler")],
    ids=["hangs", "fails"],
)
def test_a_compiler_that_hangs_or_fails_leaves_the_tensor_op_codec(
    compiler_body: str, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernels: None
) -> None:
    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\n{compiler_body}\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("LIGHTNING_FROZEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_codec, "COMPILE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.warns(UserWarning, match=f"{reason}.*tensor ops"):
        assert native_codec.kernels() is None
    assert time.monotonic() - start < 10  # the hung compiler's children were killed with it


# the kernels' matmuls from codes and the waiting threads, asked for in this process, then again once another OpenMP
# runtime (argv[1]) is loaded beside torch's
SECOND_RUNTIME_SCRIPT = """
import ctypes, json, os, sys, warnings
import torch
from lightning_frozen.format import codec, native_codec
from lightning_frozen.zero.compute import waiting_threads
torch.set_num_threads(len(os.sched_getaffinity(0)))
rows, fmt = codec.encode(torch.randn(64 * 64), "nf4")[None], codec.block_format("nf4")
def asked():
    native_codec.blas_sgemm.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matmuls = [native_codec.CodedMatmuls.of(rows, 64 * 64, fmt) for layer in range(2)]
    waits = waiting_threads.for_this_process()
    if waits is not None:
        waits.close()
    return {"matmuls": [m is not None for m in matmuls], "waits": waits is not None,
            "warnings": [str(w.message) for w in caught]}
alone = asked()
ctypes.CDLL(sys.argv[1])
print(json.dumps({"alone": alone, "beside": asked()}))
"""


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    return {os.path.realpath(field[5].strip()) for field in fields if len(field) == 6}


def _second_openmp_runtime(kind: str) -> str:
    """A file of ``kind``'s OpenMP runtime that this process has not loaded; else a visible skip."""
    if kind == "another libgomp":  # GCC's own, beside the copy torch brought (a wheel that renamed its libgomp)
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            pytest.skip("no C compiler, so no GCC libgomp beside torch's")
        found = subprocess.run([compiler, "-print-file-name=libgomp.so.1"], capture_output=True, text=True)
        path = os.path.realpath(found.stdout.strip())
        if not os.path.isabs(found.stdout.strip()) or not os.path.isfile(path) or path in _mapped_files():
            pytest.skip(f"no libgomp other than torch's here ({found.stdout.strip()!r})")
        return path
    found = ctypes.util.find_library(kind.removeprefix("lib"))
    if found is None:
        pytest.skip(f"no {kind} on the loader's path (`ldconfig -p`)")
    return found


@pytest.mark.parametrize("kind", ["another libgomp", "libomp", "libiomp5"])
def test_a_second_openmp_runtime_turns_the_kernels_matmuls_and_the_waiting_threads_off_with_one_line(
    kind: str,
) -> None:
    runtime = _second_openmp_runtime(kind)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    result = subprocess.run(
        [sys.executable, "-c", SECOND_RUNTIME_SCRIPT, runtime], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    if report["alone"]["matmuls"] == [False, False]:
        pytest.skip("torch exports no MKL sgemm here")
    cpus = len(os.sched_getaffinity(0))
    assert report["alone"] == {"matmuls": [True, True], "waits": cpus >= 2, "warnings": []}
    beside = report["beside"]
    assert beside["matmuls"] == [False, False] and not beside["waits"], beside
    # one line for both layers, naming the runtime that was loaded
    assert len(beside["warnings"]) == 1 and "row tiles" in beside["warnings"][0], beside["warnings"]
    assert (runtime if os.path.isabs(runtime) else runtime.split(".")[0]) in beside["warnings"][0]
