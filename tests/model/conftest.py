import pytest


@pytest.fixture(scope="session")
def mla_dirs(tmp_path_factory):
    """`mla_dirs(arch, **overrides)`: a tiny GLM-5 / DeepSeek model
    (`tests.model.mla_support.MLA_TINY`), written once per pytest process."""
    from tests.model.mla_support import MlaModelDirs

    return MlaModelDirs(tmp_path_factory.mktemp("mla-models"))
