"""The native kernels' cache, read in this process: a library is loaded only when it is this
user's, writable by no one else, and the very file its build recorded; an unusable cache path is
a reason to fall back, never a crash; the key covers what the library links against; ``--clean``
removes this checkout's build.

Every test plants its files in a temporary cache (``MASKLN_NATIVE_CACHE``), copying this
process's own build. Nothing here dlopens a planted file: the checks run before any load (the
process-spawning cases, and a real rebuild, are in ``test_native_cache_hostile.py``).
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

import pytest

from maskln_cli.op import backend, native
from maskln_cli.op.native import cache
from maskln_cli.op.native.__main__ import main as native_main
from tests.clitools import invoke

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 12345


@pytest.fixture(scope="module")
def own_build() -> tuple[Path, Path]:
    """This process's library and its build record (in the real cache: read only)."""
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernel unavailable: {reason}")
    library = native.library_path()
    return library, cache.record_path(library)


def plant(own_build: tuple[Path, Path]) -> Path:
    """A copy of this process's build, with its record, at the library path of the cache the
    environment names now."""
    library = native.library_path()
    cache.make_folders(library.parent)
    shutil.copy(own_build[0], library)
    shutil.copy(own_build[1], cache.record_path(library))
    return library


@pytest.fixture
def planted(own_build, monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    return plant(own_build)


def refused_without_loading(match: str) -> None:
    """The cache's state says the native kernels cannot be used, and why; loading (even with a
    build allowed) refuses before opening the library."""
    state = native.state()
    assert state.library is None and state.problem is not None, state
    assert match in state.problem, state.problem
    shown = backend.cached_state()
    assert shown.name == "raw" and match in str(shown), shown
    for build in (False, True):
        with pytest.raises(native.NativeUnavailable) as raised:
            native._load_or_build(build)
        assert not isinstance(raised.value, native.NotBuiltYet)
        assert match in str(raised.value)


def test_a_whole_trusted_build_is_what_loads(planted):
    """The control: a copy of the build with its record is ready to load."""
    assert native.state().library == planted
    assert backend.cached_state().name == "native"
    assert native._load_or_build(build=False) is native.load()


# --- damaged ----------------------------------------------------------------------------------


def _truncate(library: Path) -> None:
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])


def _other_library(library: Path) -> None:
    # a real shared library without the module's symbols
    torch_lib = cache.torch_folder() / "lib"  # type: ignore[operator]
    shutil.copy(min(torch_lib.glob("libshm*.so"), key=lambda p: p.stat().st_size), library)


def _flip_one_byte(library: Path) -> None:
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 1
    library.write_bytes(bytes(data))


DAMAGE = {
    "empty": (lambda library: library.write_bytes(b""), "is 0 bytes"),
    "garbage": (lambda library: library.write_bytes(os.urandom(50_000)), "is 50000 bytes"),
    "truncated": (_truncate, "bytes, not the"),
    "another library (missing symbols)": (_other_library, "bytes, not the"),
    "one byte changed": (_flip_one_byte, "differs from what its build wrote"),
    "no build record": (lambda library: cache.record_path(library).unlink(), "no build record"),
    "a garbled record": (
        lambda library: cache.record_path(library).write_text("{"),
        "no build record",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_file_its_build_did_not_record_is_never_loaded(planted, damage):
    """Whatever is at the library's path, when it is not the file its build recorded it is
    not loaded (not even opened by the dynamic loader): the first use rebuilds it, and
    ``--version`` says so."""
    change, reason = DAMAGE[damage]
    change(planted)
    state = native.state()
    assert state.library is None and state.problem is None
    assert reason in state.todo and "rebuilt on first use" in state.todo, state.todo
    shown = backend.cached_state()
    assert shown.name == "native" and "rebuilt on first use" in str(shown)
    with pytest.raises(native.NotBuiltYet, match=reason):
        native._load_or_build(build=False)


# --- untrusted --------------------------------------------------------------------------------

MODES = {
    "the entry folder writable by its group": (lambda lib: lib.parent, 0o770, "by its group"),
    "the cache writable by all": (lambda lib: lib.parents[2], 0o777, "group and others"),
    "the library writable by others": (lambda lib: lib, 0o757, "by its others"),
    "the record writable by its group": (cache.record_path, 0o664, "by its group"),
}


@pytest.mark.parametrize("case", MODES, ids=list(MODES))
def test_a_cache_others_may_write_to_is_refused(planted, case):
    where, mode, match = MODES[case]
    where(planted).chmod(mode)
    refused_without_loading(match)


@pytest.mark.skipif(not AS_ROOT, reason="giving a file to another user needs root")
@pytest.mark.parametrize("what", ["the library", "the record", "the whole cache"])
def test_a_cache_another_user_owns_is_refused(planted, what):
    """A library another user owns (or put in a folder of theirs) is never loaded: whoever
    runs maskln would run their code."""
    if what == "the whole cache":
        for folder, _, files in os.walk(planted.parents[2]):
            for path in [folder, *(os.path.join(folder, name) for name in files)]:
                os.chown(path, OTHER_UID, OTHER_UID)
    else:
        target = planted if what == "the library" else cache.record_path(planted)
        os.chown(target, OTHER_UID, OTHER_UID)
    refused_without_loading(f"owned by uid {OTHER_UID}")


@pytest.mark.skipif(not AS_ROOT, reason="giving a folder to another user needs root")
def test_a_cache_inside_another_users_folder_is_refused(own_build, monkeypatch, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    monkeypatch.setenv(native.CACHE_ENV, str(theirs / "cache"))
    plant(own_build)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    refused_without_loading(f"{theirs} is owned by uid {OTHER_UID}")


def test_a_cache_in_a_folder_all_may_write_to_needs_its_sticky_bit(
    own_build, monkeypatch, tmp_path
):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv(native.CACHE_ENV, str(shared / "cache"))
    library = plant(own_build)
    shared.chmod(0o1777)  # as /tmp: others cannot rename or remove what is not theirs
    assert native.state().library == library
    shared.chmod(0o777)
    refused_without_loading("writable by everyone and not sticky")


# --- unusable paths ---------------------------------------------------------------------------


def _home_unknown(monkeypatch, tmp_path) -> str:
    for name in (native.CACHE_ENV, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    return "the home folder is unknown"


def _too_long(monkeypatch, tmp_path) -> str:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / ("x" * 300) / "cache"))
    return "File name too long"


def _a_file(monkeypatch, tmp_path) -> str:
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    return "is not a folder"


UNUSABLE = {"HOME unset": _home_unknown, "a 300-character name": _too_long, "a file": _a_file}


@pytest.mark.parametrize("case", UNUSABLE, ids=list(UNUSABLE))
def test_an_unusable_cache_path_is_a_reason_to_fall_back(monkeypatch, tmp_path, case):
    """No cache to use: the native kernels are unavailable, with the reason; never an
    exception from ``--version`` or from the loader."""
    match = UNUSABLE[case](monkeypatch, tmp_path)
    refused_without_loading(match)
    # --version in this process, as a fresh one asking for the native kernels would see it
    monkeypatch.setattr(backend, "_native", None)
    monkeypatch.setattr(backend, "_failure", None)
    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert "op backend: raw (native kernels unavailable:" in result.stdout
    assert match in result.stdout


# --- the key, clean, rebuild ------------------------------------------------------------------


def test_the_key_covers_the_compiler_and_torchs_build(monkeypatch, tmp_path):
    """A shared home seen from another machine (another compiler, another torch build of the
    same version) keys another folder: never a build made against something else."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    here = native.build_directory()
    assert native.source_hash() in here.name and native.torch_version() in here.name
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with_another_compiler = native.build_directory()
    monkeypatch.delenv("CXX")
    version_file = cache._torch_version_file()
    monkeypatch.setattr(cache, "_torch_version_file", lambda: version_file + "\n# another build")
    with_another_torch = native.build_directory()
    assert len({here, with_another_compiler, with_another_torch}) == 3


def test_clean_removes_this_checkouts_build_and_nothing_else(planted, capsys):
    other = planted.parents[1] / "torch-another-build"
    other.mkdir()
    (other / "maskln_native_0.so").write_bytes(b"another build")
    assert native_main(["--clean"]) == 0
    assert f"removed {planted.parent}" in capsys.readouterr().out
    assert not planted.parent.exists() and (other / "maskln_native_0.so").exists()
    assert native_main(["--clean"]) == 0
    assert "no build of this checkout" in capsys.readouterr().out


def test_the_rebuild_variable_asks_each_process_for_a_new_build(planted, monkeypatch):
    """MASKLN_NATIVE_REBUILD=1: a build older than this process is rebuilt; one made after the
    process started (by a process it waited for) is loaded."""
    monkeypatch.setenv(native.REBUILD_ENV, "1")
    state = native.state()
    assert state.library is None and "MASKLN_NATIVE_REBUILD is set" in state.todo, state
    with pytest.raises(native.NotBuiltYet, match="MASKLN_NATIVE_REBUILD is set"):
        native._load_or_build(build=False)
    monkeypatch.setattr(native, "_STARTED", 0.0)
    assert native.state().library == planted
