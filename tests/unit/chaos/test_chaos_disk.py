"""A full disk makes writes fail with ENOSPC; clearing it frees the space."""

from __future__ import annotations

import errno
import os

import pytest

from resilient_chaos.disk import FillDisk, SmallVolume, mount_unavailable
from resilient_chaos.injectors import InjectionFailed

REASON = mount_unavailable()


def write(path, n=64 * 1024):
    with open(path, "wb") as f:
        f.write(b"y" * n)
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.skipif(REASON is not None, reason=f"cannot mount a tmpfs: {REASON}")
def test_full_disk_raises_enospc_until_cleared():
    with SmallVolume(4 << 20) as vol:
        assert os.path.ismount(vol.path) and vol.url.startswith("file://")
        write(vol.path / "before")
        with FillDisk(vol.path, target="durable") as inj:
            assert inj.record.status == "injected"
            with pytest.raises(OSError) as e:
                write(vol.path / "during")
            assert e.value.errno == errno.ENOSPC
        assert not inj.filler.exists()
        write(vol.path / "after")
        path = vol.path
    assert not os.path.ismount(path) and not path.exists()


def test_refuses_to_fill_a_big_filesystem(tmp_path):
    with pytest.raises(InjectionFailed, match="refusing to fill"):
        FillDisk(tmp_path, max_bytes=1 << 20).inject()
    assert not any(tmp_path.iterdir())
