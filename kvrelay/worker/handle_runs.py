"""Which bytes of a prefill handle a rank reads: the overlap of the handle
writer's rectangle runs with the reader's, page by page. Decode's target
pull and its draft pull both plan their reads with these."""

from __future__ import annotations


def intersect(mine, theirs) -> list[tuple[int, int]]:
    """(offset in page, length) of each overlap of two run lists within one page."""
    out = []
    for t_off, t_len in theirs:
        for m_off, m_len in mine:
            start, end = max(m_off, t_off), min(m_off + m_len, t_off + t_len)
            if start < end:
                out.append((start, end - start))
    return out


def overlap_reads(handle, theirs, held, mine, start: int, end: int):
    """Yields (page, remote run, offset in page) for each byte run of pages
    [start, end) that `handle` holds (its pages `held`, each laid out as the
    runs `theirs`) and the reader's runs `mine` also cover."""
    overlap = intersect(mine, theirs)
    if not overlap:
        return
    for slot, page in enumerate(held):
        if start <= page < end:
            base = handle.runs[slot * len(theirs)][0] - theirs[0][0]
            for offset, length in overlap:
                yield page, (base + offset, length), offset
