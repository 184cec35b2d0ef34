import pytest


@pytest.fixture
def paired(monkeypatch):
    """GACT's estimator with the other tensors at their widths in every probe pass, measuring by pairs where a base
    pass's draw is not a pair's other one (``sensitivity.EXACT_BASE`` off): what the tests of that mode's passes
    count."""
    from gactx.controller.adaptation import sensitivity

    monkeypatch.setattr(sensitivity, "EXACT_BASE", False)
