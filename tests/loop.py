"""tools/loopdrives.py for the tests: a machine that cannot make the drive skips the test."""

import contextlib
import pathlib

import pytest
from loopdrives import Unavailable, fail_device  # noqa: F401 (the tests take it from here)
from loopdrives import loop_file_system as _loop_file_system
from loopdrives import throttled as _throttled


def entered(stack: contextlib.ExitStack, cm):
    try:
        return stack.enter_context(cm)
    except Unavailable as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def loop_file_system(tmp_path, name: str = "drive", size: int = 32 << 20):
    """loopdrives.loop_file_system in tmp_path; the mount point as a Path."""
    with contextlib.ExitStack() as stack:
        mnt, dev, image = entered(stack, _loop_file_system(str(tmp_path), name, size))
        yield pathlib.Path(mnt), dev, image


@contextlib.contextmanager
def throttled(limits: dict[str, int]):
    with contextlib.ExitStack() as stack:
        entered(stack, _throttled(limits))
        yield
