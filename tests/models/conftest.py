"""Every store test starts from an empty store."""

import pytest


@pytest.fixture(autouse=True)
def _empty_store(tfserve_home):
    return tfserve_home
