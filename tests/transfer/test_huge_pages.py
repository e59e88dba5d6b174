"""`collapse_to_huge_pages`: an allocated, written tensor moves onto
transparent huge pages with its bytes unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.transfer.arena import collapse_to_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (this process)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off"
)
def test_a_written_tensor_moves_onto_huge_pages_unchanged():
    tensor = torch.randint(0, 255, (24 << 20,), dtype=torch.uint8)  # 4 KiB pages, resident
    before = tensor.clone()
    collapsed = collapse_to_huge_pages(tensor)
    assert collapsed >= 20 << 20  # the whole 2 MiB pages inside it
    assert collapsed % (2 << 20) == 0
    assert huge_kib_at(tensor.data_ptr() + (4 << 20)) * 1024 >= collapsed
    assert torch.equal(tensor, before)


def test_memory_without_a_whole_huge_page_is_left_alone():
    tensor = torch.ones(4096, dtype=torch.uint8)
    assert collapse_to_huge_pages(tensor) == 0
    assert int(tensor.sum()) == 4096
