"""Drives for the tests and benchmarks, made as root: ext4 file systems on loop devices,
and the cgroup v1 `blkio` read throttle that makes one slower than another. Each helper
raises Unavailable (the tests skip, the benchmarks say so) when the machine cannot make
one: not root, no loop devices, no blkio controller."""

import contextlib
import os
import subprocess

BLKIO = "/sys/fs/cgroup/blkio"


class Unavailable(Exception):
    """This machine cannot make the drive asked for (the message says why)."""


@contextlib.contextmanager
def loop_file_system(where, name: str = "drive", size: int = 32 << 20):
    """An ext4 file system on a loop device over the file WHERE/NAME.img, mounted on
    WHERE/NAME; yields (mount point, device path, image), paths as strings. Unmounted and
    detached after."""
    if os.geteuid() != 0:
        raise Unavailable("needs root for a loop device")
    image, mnt = os.path.join(where, f"{name}.img"), os.path.join(where, name)
    with open(image, "wb") as f:
        f.truncate(size)
    os.makedirs(mnt)
    try:
        dev = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise Unavailable(f"no loop device here: {e}") from None
    try:
        subprocess.run(["mkfs.ext4", "-q", dev], check=True, capture_output=True)
        subprocess.run(["mount", dev, mnt], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        subprocess.run(["losetup", "-d", dev])
        raise Unavailable(f"cannot make a file system on {dev}: {e}") from None
    try:
        yield mnt, dev, image
    finally:
        subprocess.run(["umount", "-l", mnt])
        subprocess.run(["losetup", "-d", dev])


def fail_device(dev: str, image: str) -> None:
    """Make every read of the loop device `dev` beyond its first MiB fail with EIO, as a
    dying drive's do: its backing file shrinks, and the device with it."""
    os.truncate(image, 1 << 20)
    subprocess.run(["losetup", "--set-capacity", dev], check=True)


def disk_of(path: str) -> str:
    """The whole disk (/dev/NAME) the file system holding `path` is on (a partition's disk)."""
    st = os.stat(path)
    block = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if os.path.exists(os.path.join(block, "partition")):
        block = os.path.dirname(block)
    return "/dev/" + os.path.basename(block)


def device_number(dev: str) -> str:
    with open(f"/sys/block/{os.path.basename(dev)}/dev") as f:
        return f.read().strip()


@contextlib.contextmanager
def throttled(limits: dict[str, int]):
    """This process (all its threads) in a blkio cgroup reading each device of `limits`
    ({device path: bytes per second}) at most that fast; moved back out after."""
    if not os.path.isfile(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
        raise Unavailable("no cgroup v1 blkio throttle here")
    group = os.path.join(BLKIO, f"colibri-test-{os.getpid()}")
    os.makedirs(group, exist_ok=True)
    try:
        for dev, bps in limits.items():
            with open(os.path.join(group, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{device_number(dev)} {bps}")
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        yield
    finally:
        with open(os.path.join(BLKIO, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
