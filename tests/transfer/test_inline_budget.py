"""Pulls done inline give the event loop a turn once their time adds up to
`YIELD_AFTER_S`, not after every pull (a yield costs a tenth of a small
pull's overhead from a cold cache), so back-to-back inline pulls cannot
starve the loop's other tasks."""

import asyncio

import pytest

from kvrelay.transfer.inline import YIELD_AFTER_S, InlineBudget


@pytest.mark.asyncio
async def test_inline_work_yields_once_it_adds_up_to_the_budget():
    budget = InlineBudget()
    ran = []
    other = asyncio.get_running_loop().call_soon(ran.append, "other")
    small = YIELD_AFTER_S / 4
    for _ in range(3):  # three quarters of the budget: no turn for the loop
        await budget.spent(small)
    assert ran == []
    await budget.spent(small)  # the budget is used up: the loop runs `other`
    assert ran == ["other"]
    other.cancel()
    asyncio.get_running_loop().call_soon(ran.append, "again")
    await budget.spent(small)  # a fresh budget after the yield
    assert ran == ["other"]
    await budget.spent(YIELD_AFTER_S)  # one long pull yields at once
    assert ran == ["other", "again"]
