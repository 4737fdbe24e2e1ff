import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet_hf():
    # transformers announces future API changes of its own on every model built; they are
    # not ours to fix (DeprecationWarnings are not hidden: pytest lists them)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        yield
