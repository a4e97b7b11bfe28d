"""The warmup-stable-decay learning rate is a pure function of the step."""

import math

import pytest

from optim import lr_at

TRAIN = {"lr": 1e-3, "max_steps": 100, "warmup_steps": 10, "decay_fraction": 0.2, "min_lr_ratio": 0.1}


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_warms_up_linearly_holds_the_peak_then_decays_to_the_floor(shape):
    train = TRAIN | {"decay_shape": shape}
    lrs = [lr_at(step, train) for step in range(100)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert lrs[10:80] == pytest.approx([1e-3] * 70)
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:], strict=False)), "decay is strictly decreasing"
    assert lrs[-1] == pytest.approx(1e-4)


def test_decay_shapes_follow_their_formulas():
    halfway = 89  # (89 - 80 + 1) / 20 = 0.5 of the decay done
    linear = lr_at(halfway, TRAIN | {"decay_shape": "linear"})
    one_minus_sqrt = lr_at(halfway, TRAIN | {"decay_shape": "1-sqrt"})
    assert linear == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert one_minus_sqrt == pytest.approx(1e-3 * (0.1 + 0.9 * (1 - math.sqrt(0.5))))


def test_no_decay_and_no_warmup_is_a_constant_rate():
    train = TRAIN | {"warmup_steps": 0, "decay_fraction": 0.0, "decay_shape": "linear"}
    assert {lr_at(step, train) for step in range(100)} == {1e-3}
