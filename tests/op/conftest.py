import pytest

from maskln_cli.op import backend


@pytest.fixture
def on_backend():
    """``on_backend(name)``: the op computes with that backend until the test ends (skipped when
    it is the native one and that cannot load here); then the choice is as it was."""
    previous = backend.requested()

    def choose(name: str) -> None:
        backend.set_backend(name)
        if name == "native" and backend.native_kernels() is None:
            pytest.skip(f"native kernels unavailable: {backend.active_backend().reason}")

    yield choose
    # set_backend, not None again: with the native kernels loaded, a None choice would run them
    # whatever MASKLN_BACKEND says (the choice is read once, not per call)
    backend.set_backend(previous)
