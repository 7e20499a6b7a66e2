"""The code cache (``base/code_cache.py``, ``zero/frozen_files.py``): the first fit of a base writes its stored shards
into one file, later fits map it and read no tensor of the folder; a changed folder, a file cut short, another
``frozen_dtype``, a place that cannot be written and two fits at once each do what a user would expect. Real DeepSpeed
on the CPU, real Lightning Trainers and transformers/PEFT models, in this process (one rank) and in subprocesses (two
ranks; two jobs at once)."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.base import code_cache
from lightning_frozen.zero import frozen_files
from tests.distributed import SCRIPTS, fresh_env, read_reports, run_script
from tests.models import cpu_trainer
from tests.pretrained_support import TINY_LLAMA, held_frozen, token_data, write_llama, write_random_llama

sys.path.insert(0, str(SCRIPTS))
from code_cache_fit import SeededLoRA  # noqa: E402


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_llama(tmp_path / "llama")


def fit(folder: Path, cache: Any, monkeypatch: pytest.MonkeyPatch, frozen_dtype: str = "nf4") -> dict[str, Any]:
    """One fit of LoRA over ``folder`` with ``code_cache=cache``: the positioned reads of the folder it made, the
    frozen shards as held and the trained weights."""
    reads = [0]
    preadv = os.preadv

    def counting(*arguments: Any) -> int:
        reads[0] += 1
        return preadv(*arguments)

    monkeypatch.setattr(os, "preadv", counting)
    torch.manual_seed(0)
    model = SeededLoRA(str(folder))
    strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype, code_cache=cache)
    cpu_trainer(strategy, max_steps=2, precision="bf16-true").fit(model, token_data())
    monkeypatch.setattr(os, "preadv", preadv)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"reads": reads[0], "held": held_frozen(model), "trained": trained}


def files(cache: Path) -> list[str]:
    return sorted(path.name for path in cache.glob("*.codes"))


def test_the_second_fit_maps_the_file_and_reads_no_tensor_of_the_folder(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: Any
) -> None:
    cache = tmp_path / "codes"
    first = fit(folder, cache, monkeypatch)
    assert first["reads"] >= 21 and len(files(cache)) == 1  # one read a tensor at least
    assert "wrote the code cache" in lightning_log.text
    advised: list[tuple[int, int, int]] = []
    advise = frozen_files.MappedFile.advise
    monkeypatch.setattr(frozen_files.MappedFile, "advise", lambda self, *how: advised.append(how) or advise(self, *how))
    second = fit(folder, cache, monkeypatch)
    assert second["reads"] == 0
    assert [how for how in advised if how[0] == mmap.MADV_WILLNEED]  # the gathers asked for the next pages ahead
    assert "mapped the frozen base from the code cache" in lightning_log.text
    (summary,) = [line for line in lightning_log.lines if "Per rank: frozen shards" in line][1:]
    assert f"(nf4) in a mapped file ({cache / files(cache)[0]}: page cache, not this process's memory)" in summary
    assert second["held"]["codes"] == first["held"]["codes"]  # the same bytes in every shard
    assert all(second["held"]["quantized_equal"].values()) and second["held"]["quantized_equal"]
    assert second["held"]["fingerprint"] == first["held"]["fingerprint"]
    assert second["held"]["quantized_at_load"] == first["held"]["quantized_at_load"] == 21
    for name, value in first["trained"].items():  # the same training from the mapped codes
        assert torch.equal(second["trained"][name], value), name
    assert code_cache.verify(cache / files(cache)[0]) == []


def test_a_changed_folder_is_read_again_and_its_old_file_removed_with_one_line_why(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: Any
) -> None:
    cache = tmp_path / "codes"
    fit(folder, cache, monkeypatch)
    (old,) = files(cache)
    write_random_llama(folder, TINY_LLAMA, torch.bfloat16, seed=1)  # new values, the same names and shapes
    changed = fit(folder, cache, monkeypatch)
    assert changed["reads"] >= 21
    assert all(changed["held"]["quantized_equal"].values())  # the new folder's values, not the old file's
    assert old not in files(cache) and len(files(cache)) == 1
    (why,) = [line for line in lightning_log.lines if "writing the code cache" in line][1:]
    assert "the folder changed since the last one was written" in why and "model.safetensors" in why


@pytest.mark.parametrize("damage", ["cut short", "index renamed"])
def test_a_file_cut_short_or_not_this_base_s_is_never_mapped(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: Any, damage: str
) -> None:
    cache = tmp_path / "codes"
    first = fit(folder, cache, monkeypatch)
    (name,) = files(cache)
    path = cache / name
    if damage == "cut short":
        os.truncate(path, path.stat().st_size - 10)
    else:  # the head and size intact, the index naming another file
        data = path.read_bytes()
        path.write_bytes(data.replace(name.removesuffix(".codes").encode(), b"0" * len(name.removesuffix(".codes"))))
    again = fit(folder, cache, monkeypatch)
    assert again["reads"] >= 21 and again["held"]["codes"] == first["held"]["codes"]
    assert files(cache) == [name] and code_cache.verify(path) == []  # written again, whole
    if damage == "cut short":
        assert any("the one there was cut short or damaged" in line for line in lightning_log.lines)


def test_a_row_changed_on_disk_is_found_by_the_full_check(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "codes"
    fit(folder, cache, monkeypatch)
    (name,) = files(cache)
    with open(cache / name, "r+b") as file:  # one byte of the first param's row (the rows start at 4096)
        file.seek(4096)
        byte = file.read(1)
        file.seek(4096)
        file.write(bytes([byte[0] ^ 0xFF]))
    (problem,) = code_cache.verify(cache / name)
    assert "row 0 differs from when it was written" in problem


def test_another_frozen_dtype_has_a_file_of_its_own(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "codes"
    fit(folder, cache, monkeypatch, "nf4")
    int8 = fit(folder, cache, monkeypatch, "int8")
    assert int8["reads"] >= 21 and len(files(cache)) == 2
    assert all(int8["held"]["quantized_equal"].values())
    assert fit(folder, cache, monkeypatch, "nf4")["reads"] == 0


@pytest.mark.parametrize("place", ["under a file", "another user's"])
def test_a_place_that_cannot_be_used_says_so_once_and_the_fit_loads_as_before(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: Any, place: str
) -> None:
    cache = tmp_path / "file" / "codes"
    if place == "under a file":  # as a read-only home fails to make it (root may write anywhere else)
        (tmp_path / "file").write_text("")
        why = "cannot be made"
    else:
        cache.mkdir(parents=True, mode=0o777)
        os.chmod(cache, 0o777)  # past the umask: any user may write it
        why = "could be written by another user"
    loaded = fit(folder, cache, monkeypatch)
    assert loaded["reads"] >= 21 and all(loaded["held"]["quantized_equal"].values())
    (line,) = [line for line in lightning_log.lines if "the code cache is not used" in line]
    assert why in line


def test_code_cache_false_writes_nothing(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_FROZEN_CODE_CACHE", str(tmp_path / "codes"))
    assert fit(folder, False, monkeypatch)["reads"] >= 21
    assert not (tmp_path / "codes").exists()


def test_two_jobs_starting_together_write_one_file_and_train_alike(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "codes"
    jobs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "code_cache_fit.py"), "--folder", str(folder), "--cache", str(cache)]
            + ["--out", str(tmp_path / f"job{job}"), "--fits", "1"],
            env=fresh_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for job in range(2)
    ]
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    reports = [read_reports(tmp_path / f"job{job}" / "fit0")[0] for job in range(2)]
    assert len(files(cache)) == 1 and not list(cache.glob("partial-*"))
    writers = [report for report in reports if any("wrote the code cache" in line for line in report["lines"])]
    assert len(writers) == 1  # the other waited for it, then mapped it
    assert sorted(report["reads"] == 0 for report in reports) == [False, True]
    assert reports[0]["trained"] == reports[1]["trained"] and reports[0]["held"] == reports[1]["held"]


@pytest.mark.slow
def test_two_ranks_write_one_file_then_map_it_and_read_each_others_rows(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "codes"
    run_script("code_cache_fit.py", "--folder", str(folder), "--cache", str(cache), "--out", str(tmp_path / "out"))
    run_script(
        "code_cache_fit.py", "--devices", "2", "--folder", str(folder), "--cache", str(cache), "--out", str(tmp_path)
    )
    written, mapped = read_reports(tmp_path / "fit0"), read_reports(tmp_path / "fit1")
    assert len(written) == len(mapped) == 2 and len(files(cache)) == 2  # one rank's layout, then two ranks'
    for first, second in zip(written, mapped):
        assert first["reads"] > 0 and second["reads"] == 0
        assert first["shared"] == second["shared"] == second["frozen"] > 0  # every rank's codes where they lie
        assert second["held"] == first["held"] and second["trained"] == first["trained"]
        # the file's pages are the page cache's: none copied into this process's anonymous memory
        assert second["mappings"]["rss"] > 0 and second["mappings"]["anonymous"] == 0
    assert json.dumps(written[0]["trained"]) == json.dumps(written[1]["trained"])


def test_the_command_lists_checks_and_clears_the_cache(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from lightning_frozen.cli import main

    cache = tmp_path / "codes"
    fit(folder, cache, monkeypatch)
    (name,) = files(cache)
    capsys.readouterr()  # what the fit printed
    main(["cache", "--dir", str(cache), "--verify"])
    listed = capsys.readouterr().out
    assert (
        listed.startswith("lightning-frozen cache: 1 files, ") and f"{name} " in listed and listed.endswith(": whole\n")
    )
    os.utime(folder / "model.safetensors")  # a newer time: the folder may have changed
    main(["cache", "--dir", str(cache), "--verify"])
    assert "model.safetensors changed since it was written" in capsys.readouterr().out
    main(["cache", "--dir", str(cache), "--clear"])
    assert capsys.readouterr().out.startswith("lightning-frozen cache: removed 1 files (")
    assert files(cache) == []


def test_a_file_larger_than_memory_and_swap_maps(tmp_path: Path) -> None:
    # a private writable mapping reserves its size under the kernel's default overcommit rule, which refuses more
    # than memory and swap: a 70B's cache file was then never mapped again (found by benchmarks/code_cache)
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    memory = sum(int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "SwapTotal"))
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "0":
        pytest.skip("the kernel's overcommit rule is not its default here")
    path = tmp_path / "sparse.codes"
    with open(path, "wb") as file:
        file.truncate(2 * memory)  # sparse: no disk taken
    os.chmod(path, 0o600)
    mapped = frozen_files.open_file(path, 2 * memory)
    assert mapped is not None and mapped.data.numel() == 2 * memory
    assert int(mapped.data[memory]) == 0  # a page of the hole reads as zeros, in place


def test_beyond_its_size_limit_the_least_recently_used_file_goes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: Any
) -> None:
    cache = tmp_path / "codes"
    first, second = write_llama(tmp_path / "first"), write_llama(tmp_path / "second")
    fit(first, cache, monkeypatch)
    (kept,) = files(cache)
    size = (cache / kept).stat().st_size
    monkeypatch.setenv("LIGHTNING_FROZEN_CODE_CACHE_GB", str(1.5 * size / 2**30))  # room for one file, not two
    fit(second, cache, monkeypatch)
    assert len(files(cache)) == 1 and kept not in files(cache)  # the first base's file made room
    (newer,) = files(cache)
    monkeypatch.setenv("LIGHTNING_FROZEN_CODE_CACHE_GB", str(0.5 * size / 2**30))  # room for none
    assert fit(first, cache, monkeypatch)["reads"] >= 21
    assert files(cache) == [newer]  # nothing removed for a file that could not be written anyway
    (line,) = [line for line in lightning_log.lines if "the code cache is not used" in line]
    assert "within a limit of" in line and "LIGHTNING_FROZEN_CODE_CACHE_GB" in line
