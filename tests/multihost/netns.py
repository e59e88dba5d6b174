"""Two hosts on one machine for tests (`kvrelay.bench.netns`): skipped, with the
reason, where network namespaces cannot be made."""

from __future__ import annotations

import pytest

from kvrelay.bench.netns import NetnsUnavailable
from kvrelay.bench.netns import TwoHosts as _TwoHosts


class TwoHosts(_TwoHosts):
    def create(self) -> TwoHosts:
        try:
            return super().create()
        except NetnsUnavailable as exc:
            pytest.skip(str(exc))
