"""The shm rings' pages are mapped when a segment is created or attached (issue 14: no page fault per 4 KiB on a
ring's first pass, which made 4 KiB and 16 KiB ping-pongs slower than 64 KiB ones in a short benchmark)."""

from __future__ import annotations

import os
import resource

import pytest

from procgroup.transport.shm import layout
from procgroup.transport.shm.layout import create_segment, unlink_quiet

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not os.path.isdir(layout.SHM_DIR) or not layout._MADV_POPULATE_WRITE, reason="no /dev/shm"),
]

CAP = 1 << 20  # 256 pages per ring


def _faults_writing_rings(seg: layout.Segment) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for s in range(seg.nslots):
        d = seg.data(s)
        for off in range(0, CAP, 4096):
            d[off] = 1
        d.release()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("prefault", [True, False])
def test_writing_the_rings_takes_no_page_fault_once_created(prefault: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not prefault:  # the control: the same writes do fault when nothing was prefaulted
        monkeypatch.setattr(layout.Segment, "prefault_rings", lambda self: None)
    name = f"{layout.SHM_SEGMENT_PREFIX}prefault-test-{os.getpid()}-{int(prefault)}"
    seg = create_segment(name, 0, 3, [1, 2], CAP)
    try:
        n = _faults_writing_rings(seg)
        if prefault:
            assert n < 16, f"{n} page faults writing 2 rings of 256 pages after the prefault"
        else:
            assert n >= 256, n
    finally:
        seg.close()
        unlink_quiet(name)
