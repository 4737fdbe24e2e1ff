import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet_hf():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
