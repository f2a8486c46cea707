import pytest

from maskln_cli.op import backend


@pytest.fixture
def on_backend():
    """``on_backend(name)``: the op computes with that backend until the test ends (skipped when
    it is the native one and that cannot load here); then the choice is as it was."""
    chosen, previous = backend._chosen, backend.requested()

    def choose(name: str) -> None:
        backend.set_backend(name)
        if name == "native" and backend.native_kernels() is None:
            pytest.skip(f"native kernels unavailable: {backend.active_backend().reason}")

    yield choose
    backend.set_backend(previous)
    backend._chosen = chosen  # None again when the environment variable chose
