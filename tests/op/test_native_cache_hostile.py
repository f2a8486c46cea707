"""The native kernels' cache under attack, in real processes: a damaged, planted, foreign or
unreadable library at the cache path never makes maskln unusable (no 'Only a single
TORCH_LIBRARY', no SIGBUS, no hang, no traceback): it is rebuilt, or the op falls back to its
raw-op kernels with one warning, and ``--version`` says which. The remedies work: the install
step rebuilds a damaged build, ``make clean`` removes it, ``MASKLN_NATIVE_REBUILD=1`` rebuilds.
A process waiting for another's build says for whom.

Every cache here is a temporary folder (``MASKLN_NATIVE_CACHE``). One real build, into such a
folder over a planted file, is shared by the module's tests (half a minute of compiling).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from maskln_cli.op import native
from tests.clitools import ROOT, WORKED, run

pytestmark = pytest.mark.slow

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 12345
REBUILD_ENV = "MASKLN_NATIVE_REBUILD"
NATIVE = {"MASKLN_BACKEND": "native"}
"""The backend every process here asks for (make test-raw runs this module with raw chosen)."""


def record_of(library: Path) -> Path:
    return library.with_suffix(".json")


def make_private(folder: Path) -> None:
    """``folder`` and its missing parents, each readable and writable by this user alone."""
    if not folder.exists():
        make_private(folder.parent)
        folder.mkdir(0o700)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """This process's environment with ``values`` (None removes), as it was afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def library_in(root: Path, **values: str) -> Path:
    """The library path in the cache ``root`` (with these variables, e.g. CXX)."""
    with environment(**{native.CACHE_ENV: str(root)}, **values):
        return native.library_path()


@pytest.fixture(scope="session")
def rebuilt(tmp_path_factory) -> SimpleNamespace:
    """A real build, once per test session (the first pytest-xdist worker makes it, the others
    wait for its lock): garbage planted at the library path of an empty temporary cache, then
    the install step (``python -m maskln_cli.op.native``) run over it. ``source``: the library
    the other tests copy (this process's own when the install step failed)."""
    if native.build_problem() is not None:
        pytest.skip(f"cannot build here: {native.build_problem()}")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "native-rebuilt" / "cache"
    library = library_in(root)
    with native._exclusive(shared / "native-rebuilt.lock"):
        result = shared / "native-rebuilt.json"
        if not result.exists():
            make_private(library.parent)
            library.write_bytes(os.urandom(100_000))
            done = subprocess.run(
                [sys.executable, "-m", "maskln_cli.op.native"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={**os.environ, native.CACHE_ENV: str(root)},
                timeout=900,
            )
            outcome = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            result.write_text(json.dumps(outcome))
    done = SimpleNamespace(**json.loads(result.read_text()))
    source = library if done.returncode == 0 else native.library_path()
    return SimpleNamespace(root=root, library=library, done=done, source=source)


def copy_build(rebuilt: SimpleNamespace, root: Path, **values: str) -> Path:
    """The rebuilt library and its record, at the library path of the cache ``root``."""
    library = library_in(root, **values)
    make_private(library.parent)
    shutil.copy(rebuilt.source, library)
    if record_of(rebuilt.source).exists():
        shutil.copy(record_of(rebuilt.source), record_of(library))
    return library


OP_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import maskln_cli
    from maskln_cli.op import backend
    from maskln_cli.op.reference import reference_masked_layer_norm
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 33, generator=generator) * 3 + 1
    valid = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    scale, bias = torch.randn(2, 33, generator=generator)
    errors = []
    for _ in range(2):
        y = maskln_cli.masked_layer_normalization(x, valid, scale, bias)
        truth = reference_masked_layer_norm(x, valid, scale, bias, 1e-5)
        errors.append((y.double() - truth).abs().max().item())
    kernels = backend.native_kernels()
library = sys.argv[1]
print(json.dumps({
    "backend": backend.active_backend().name,
    "kernels": kernels is not None,
    "mapped": any(library in line for line in open("/proc/self/maps")),
    "errors": errors,
    "warnings": [str(w.message) for w in caught if w.category.__name__ == "NativeFallbackWarning"],
}))
"""


def run_op(library: Path, env: dict[str, str], prefix: tuple[str, ...] = ()) -> dict:
    """The op computed twice in a fresh process with ``env``: which backend, whether
    ``library`` was mapped, the errors against the float64 reference, the fallback warnings."""
    done = subprocess.run(
        [*prefix, sys.executable, "-c", OP_SCRIPT, str(library)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **NATIVE, **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "TORCH_LIBRARY" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    assert max(report["errors"]) < 1e-5, report  # float32 against float64, either backend
    return report


def assert_falls_back_once(report: dict, reason: str) -> None:
    assert report["backend"] == "raw" and not report["kernels"] and not report["mapped"], report
    assert len(report["warnings"]) == 1, report["warnings"]
    assert reason in report["warnings"][0], report["warnings"]


def assert_commands_work_on_raw(env: dict[str, str], reason: str, tmp_path: Path) -> None:
    """``--version`` says raw and why; ``normalize`` exits 0 with the raw backend's bytes."""
    version = run("--version", environment={**NATIVE, **env})
    assert version.returncode == 0, version.stderr
    assert b"op backend: raw (native kernels unavailable:" in version.stdout, version.stdout
    assert reason.encode() in version.stdout, version.stdout
    out, raw_out = tmp_path / "out.safetensors", tmp_path / "raw.safetensors"
    done = run("normalize", "-q", WORKED, out, environment={**NATIVE, **env})
    assert done.returncode == 0, done.stderr
    run("normalize", "-q", WORKED, raw_out, environment={"MASKLN_BACKEND": "raw"})
    assert out.read_bytes() == raw_out.read_bytes()


# --- the install step's rebuild, and the build it makes ----------------------------------------


def test_the_install_step_rebuilds_a_damaged_library(rebuilt):
    done = rebuilt.done
    assert done.returncode == 0, done.stderr
    assert str(rebuilt.library) in done.stdout
    assert "rebuilding the native CPU kernels" in done.stderr, done.stderr
    assert "has no build record" in done.stderr, done.stderr
    env = {native.CACHE_ENV: str(rebuilt.root)}
    report = run_op(rebuilt.library, env)
    assert report["backend"] == "native" and report["mapped"] and not report["warnings"], report


# --- damaged libraries, without a compiler that could rebuild them ----------------------------


def _other_library(library: Path) -> None:
    import torch

    shutil.copy(min((Path(torch.__file__).parent / "lib").glob("libshm*.so")), library)


DAMAGE = {
    "empty": lambda library: library.write_bytes(b""),
    "garbage": lambda library: library.write_bytes(os.urandom(100_000)),
    "truncated": lambda library: library.write_bytes(library.read_bytes()[:300_000]),
    "missing symbols": _other_library,
    "no build record": lambda library: record_of(library).unlink(missing_ok=True),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_library_that_cannot_be_rebuilt_falls_back(rebuilt, tmp_path, damage):
    """With a compiler that fails, the damaged library is neither loaded nor replaced: the op
    computes on the raw-op kernels with one warning naming the damage, the API and the
    commands work, ``--version`` says raw."""
    compiler = tmp_path / "failing-c++"
    compiler.write_text("#!/bin/sh\necho 'this compiler always fails' >&2\nexit 1\n")
    compiler.chmod(0o755)
    root = tmp_path / "cache"
    library = copy_build(rebuilt, root, CXX=str(compiler))
    DAMAGE[damage](library)
    env = {native.CACHE_ENV: str(root), "CXX": str(compiler)}
    assert_falls_back_once(run_op(library, env), "and it cannot be rebuilt")
    assert_commands_work_on_raw(env, str(library), tmp_path)


# --- trust ------------------------------------------------------------------------------------


@pytest.mark.skipif(not AS_ROOT, reason="giving files to another user needs root")
@pytest.mark.parametrize("what", ["library", "cache"])
def test_a_library_another_user_owns_is_not_loaded(rebuilt, tmp_path, what):
    root = tmp_path / "cache"
    library = copy_build(rebuilt, root)
    paths = [library] if what == "library" else [root, *root.rglob("*")]
    for path in paths:
        os.chown(path, OTHER_UID, OTHER_UID)
    env = {native.CACHE_ENV: str(root)}
    reason = f"owned by uid {OTHER_UID}"
    assert_falls_back_once(run_op(library, env), reason)
    assert_commands_work_on_raw(env, reason, tmp_path)


def test_a_cache_others_may_write_to_is_not_loaded(rebuilt, tmp_path):
    root = tmp_path / "cache"
    library = copy_build(rebuilt, root)
    library.parent.chmod(0o777)
    report = run_op(library, {native.CACHE_ENV: str(root)})
    assert_falls_back_once(report, "writable by its group and others")


def test_an_unreadable_cache_folder_falls_back(rebuilt, tmp_path):
    """A cache folder this user may not read (as root: run without the capability to
    override permissions)."""
    prefix: tuple[str, ...] = ()
    if AS_ROOT:
        if shutil.which("setpriv") is None:
            pytest.skip("root reads any folder; setpriv is needed to drop that capability")
        prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
    root = tmp_path / "cache"
    library = copy_build(rebuilt, root)
    (root / "native").chmod(0)
    try:
        report = run_op(library, {native.CACHE_ENV: str(root)}, prefix)
        assert_falls_back_once(report, "Permission denied")
        version = subprocess.run(
            [*prefix, sys.executable, "-m", "maskln_cli", "--version"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, **NATIVE, native.CACHE_ENV: str(root)},
            timeout=60,
        )
        assert version.returncode == 0 and "Permission denied" in version.stdout, version
        assert "op backend: raw" in version.stdout, version.stdout
    finally:
        (root / "native").chmod(0o700)


# --- remedies ---------------------------------------------------------------------------------


def test_make_clean_removes_this_checkouts_build(rebuilt, tmp_path):
    """``make clean`` (here with a stand-in venv made of links to this one) removes this
    checkout's folder from the cache, and only that."""
    root = tmp_path / "cache"
    library = copy_build(rebuilt, root)
    other = library.parents[1] / "torch-another-build"
    other.mkdir()
    venv = tmp_path / "work" / "venv"
    (venv / "bin").mkdir(parents=True)
    real_venv = Path(sys.prefix)
    shutil.copy(real_venv / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(real_venv / "lib")
    (venv / "bin" / "python").symlink_to(Path(sys.executable))
    done = subprocess.run(
        ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "clean", f"VENV={venv}"],
        capture_output=True,
        text=True,
        cwd=tmp_path / "work",
        env={**os.environ, native.CACHE_ENV: str(root)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"removed {library.parent}" in done.stdout, done.stdout
    assert not library.parent.exists() and other.exists() and not venv.exists()
    assert real_venv.exists()


STAND_IN_COMPILE = """
import os, shutil, sys
from pathlib import Path
from maskln_cli.op import native
def compile(scratch, name):
    with open(sys.argv[2], "a") as log:
        log.write(f"{os.getpid()}\\n")
    built = Path(scratch) / (name + native.LIBRARY_SUFFIX)
    shutil.copy(sys.argv[1], built)
    return built
def build(library):  # the same stand-in for the loader before build records
    compile(str(library.parent), native.module_name())
    return native._import(library)
if not hasattr(native, "_compile"):
    native._build = build
native._compile = compile
print(native.load().isa())
"""


def test_the_rebuild_variable_rebuilds(rebuilt, tmp_path):
    """MASKLN_NATIVE_REBUILD=1 rebuilds a whole build (here with a stand-in compile), and the
    result loads; without it, the build is loaded as it is."""
    root = tmp_path / "cache"
    copy_build(rebuilt, root)
    log = tmp_path / "builds"
    command = [sys.executable, "-c", STAND_IN_COMPILE, str(rebuilt.source), str(log)]
    env = {**os.environ, **NATIVE, native.CACHE_ENV: str(root)}
    for variables, builds in (({REBUILD_ENV: "1"}, 1), ({}, 1)):
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, env={**env, **variables}, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert len(log.read_text().split()) == builds
    assert "MASKLN_NATIVE_REBUILD is set" not in done.stderr


def test_a_held_build_lock_says_whom_it_waits_for(tmp_path, capsys, monkeypatch):
    """Another process holds the build lock: this one says it waits, for which pid, and keeps
    saying so, then goes on once the lock is free."""
    lock = tmp_path / "build.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from pathlib import Path
                from maskln_cli.op import native
                with native._exclusive(Path({str(lock)!r})):
                    print("held", flush=True)
                    sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(native, "WAIT_NOTE_EVERY", 0.5, raising=False)
        threading.Timer(2.0, holder.stdin.close).start()
        start = time.monotonic()
        with native._exclusive(lock):
            waited = time.monotonic() - start
        err = capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert waited > 1.0
    assert f"waiting for process {holder.pid} to finish building" in err, err
    assert f"still waiting for process {holder.pid}" in err, err


@pytest.mark.parametrize("damaged", [False, True], ids=["whole", "damaged"])
def test_asking_for_the_native_kernels_before_torch_is_imported_never_hangs(
    rebuilt, tmp_path, damaged
):
    """``backend.native_kernels()`` as a process's first call (torch not imported yet: its
    import defines maskln's ops, which ask for the kernels in turn) returns the module, or
    None after one warning."""
    compiler = tmp_path / "failing-c++"
    compiler.write_text("#!/bin/sh\nexit 1\n")
    compiler.chmod(0o755)
    root = tmp_path / "cache"
    library = copy_build(rebuilt, root, CXX=str(compiler))
    if damaged:
        library.write_bytes(b"")
    script = "from maskln_cli.op import backend; print(backend.native_kernels() is not None)"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **NATIVE, native.CACHE_ENV: str(root), "CXX": str(compiler)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(not damaged)
    assert done.stderr.count("NativeFallbackWarning") == int(damaged), done.stderr
