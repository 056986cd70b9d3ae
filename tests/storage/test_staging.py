"""Copies of the expert files on another drive (storage/staging.py, `colictl drives
stage|verify`): staged resumably with every record checked, read back, verified; a flipped
byte on the copy is found and copied again; another container's directory is refused."""

import json
import os
import subprocess
import sys

import pytest

from colibri.storage.staging import STATE, StageError, stage, verify

from hf_models import build_container, flip


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("staging"), "qwen3_moe", "basic", seed=3, num_experts=16,
                           num_hidden_layers=3)


def files(c):
    return sorted({r.file for r in c.records.values()})


def test_a_stage_copies_every_file_byte_for_byte_and_resumes(container, tmp_path):
    dest = tmp_path / "copy"
    seen = []

    def interrupt(n):
        seen.append(n)
        if sum(seen) > container.record_bytes * 20:  # partway through the second file
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stage(container, str(dest), interrupt)
    names = [os.path.basename(f) for f in files(container)]
    assert (dest / names[0]).exists() and (dest / (names[1] + ".part")).exists() and not (dest / names[1]).exists()
    again = stage(container, str(dest))
    assert again["kept"] == names[:1] and again["copied"] == names[1:]
    for f in files(container):
        with open(f, "rb") as a, open(dest / os.path.basename(f), "rb") as b:
            assert a.read() == b.read()
    assert not list(dest.glob("*.part"))
    assert verify(container, str(dest)) == {"files": dict.fromkeys(names, "ok"), "bad": 0}
    assert json.loads((dest / STATE).read_text())["container"] == container.fingerprint


def test_a_flipped_byte_on_the_copy_is_found_and_copied_again(container, tmp_path):
    dest = tmp_path / "copy"
    stage(container, str(dest))
    name = os.path.basename(files(container)[1])
    rec = next(r for r in container.records.values() if os.path.basename(r.file) == name and r.expert == 5)
    flip(dest / name, rec.offset + 100)
    got = verify(container, str(dest))
    assert got["bad"] == 1 and got["files"][name] == [f"layer {rec.layer} expert 5: checksum mismatch at offset "
                                                      f"{rec.offset}"]
    cli = subprocess.run([sys.executable, "-m", "colibri.ctl", "drives", "verify", "--model", container.path,
                          str(dest)], capture_output=True, text=True)
    assert cli.returncode == 7 and f"layer {rec.layer} expert 5: checksum mismatch" in cli.stdout
    assert stage(container, str(dest))["copied"] == [name]  # marked damaged: copied again
    assert verify(container, str(dest))["bad"] == 0
    os.remove(dest / name)  # a partial copy: missing files are not damage
    assert verify(container, str(dest))["files"][name] == "missing"


def test_a_resumed_part_that_reads_back_wrong_fails_the_stage(container, tmp_path):
    dest = tmp_path / "copy"
    first = files(container)[0]
    os.makedirs(dest)
    with open(first, "rb") as a, open(dest / (os.path.basename(first) + ".part"), "wb") as b:
        data = bytearray(a.read(os.path.getsize(first) // 2))
        data[-container.record_bytes - 7] ^= 1  # inside a whole record the resume keeps
        b.write(data)
    with pytest.raises(StageError, match="reads back wrong.*checksum mismatch"):
        stage(container, str(dest))


def test_a_damaged_container_or_another_containers_copies_are_refused(container, tmp_path, tmp_path_factory):
    other = build_container(tmp_path_factory.mktemp("other"), "qwen3_moe", "basic", seed=4, num_experts=16,
                            num_hidden_layers=3)
    dest = tmp_path / "copy"
    stage(other, str(dest))
    with pytest.raises(StageError, match="another container"):
        stage(container, str(dest))
    with pytest.raises(StageError, match="another container"):
        verify(container, str(dest))
    cli = subprocess.run([sys.executable, "-m", "colibri.ctl", "drives", "stage", "--model", container.path,
                          str(dest)], capture_output=True, text=True)
    assert cli.returncode == 7 and cli.stderr.count("\n") == 1 and "another container" in cli.stderr
    rec = other.records[(other.moe_layers[1], 3)]
    flip(rec.file, rec.offset + 10)
    with pytest.raises(StageError, match=f"layer {rec.layer} expert 3 does not match.*container itself is damaged"):
        stage(other, str(tmp_path / "fresh"))
