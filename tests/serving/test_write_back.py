"""Decode's write-back to the tier when staging is short: the pages that fit
are written, the rest counted in the worker's stats (never skipped silently)."""

from __future__ import annotations

import pytest

from tests.serving import fake_control as fc
from tests.serving.conftest import PAGE, cache_args, worker_args
from tests.support.models import prompt_tokens


@pytest.mark.asyncio
async def test_write_back_without_free_staging_rows_is_counted(
    launch, control, model_dir, page_bytes
):
    """Staging of 3 rows, a 4-page conversation: the first 3 pages are written
    back and the 4th is counted in the decode's stats, not skipped silently."""
    cache = launch(*cache_args(page_bytes)).info["listen"]
    # writes nothing through; starts while the decode starts
    prefill = launch(*worker_args("prefill", model_dir, control), wait=False)
    decode = launch(*worker_args("decode", model_dir, control, cache=[cache],
                                 extra=["--write-back", "--staging-pages", 3]))  # fmt: skip
    prompt = prompt_tokens(2 * PAGE + 3, seed=123)  # 3 pages: the load takes all 3 rows
    got = await fc.serve(fc.addr(prefill), fc.addr(decode), "wb", prompt, fc.params(40))
    assert got["ok"], got
    full = (len(prompt) + len(got["tokens"]) - 1) // PAGE
    assert full == 4
    assert got["done"]["written_back_pages"] == 3
    assert (await fc.stats(decode))["writeback_skipped_pages"] == 1
    assert (await fc.stats(decode))["staging_free"] == 3
