"""kvrelay's UCX defaults (`UcxTransport`'s UCX_DEFAULTS): applied to the
context unless the environment sets the same UCX_* variable, and refused
with UCX's own reason when UCX does not know them."""

import pytest

pytest.importorskip("kvrelay._ucx")

from kvrelay import _ucx
from kvrelay.transfer.backends.ucx import UCX_DEFAULTS


def test_the_backend_defaults_are_settings_ucx_accepts(monkeypatch):
    for name in UCX_DEFAULTS:
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    _ucx.Context(UCX_DEFAULTS).close()


def test_a_default_ucx_does_not_know_is_refused(monkeypatch):
    # (Transport settings such as CMA_SEG_SIZE are checked when UCX opens the
    # transport; UCX's own settings and unknown names are refused at once.)
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    with pytest.raises(_ucx.UcxError, match="RNDV_THRESH=not-a-size"):
        _ucx.Context({"RNDV_THRESH": "not-a-size"})
    with pytest.raises(_ucx.UcxError, match="NO_SUCH_SETTING"):
        _ucx.Context({"NO_SUCH_SETTING": "1"})


def test_the_environment_wins_over_a_default(monkeypatch):
    # The bogus default would be refused (above); with the variable set it is
    # never applied, so the context starts with the user's value.
    monkeypatch.setenv("UCX_RNDV_THRESH", "1M")
    _ucx.Context({"RNDV_THRESH": "not-a-size"}).close()
