"""bench.prefill_mask on the CPU: the two masks it compares say the same thing, and each
form is measured."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from bench.prefill_mask import masks, measure


def test_the_boolean_and_additive_masks_allow_the_same_keys_and_rows_differ():
    boolean, additive = masks(3, 16, 128, mx.float32)
    allowed = np.array(boolean)
    assert allowed.shape == (3, 1, 16, 128)
    assert (np.array(additive)[allowed] == 0).all() and np.isneginf(np.array(additive)[~allowed]).all()
    assert len({allowed[i].tobytes() for i in range(3)}) == 3  # an array mask, not one shape
    assert allowed.any(axis=-1).all()  # every query sees a key


def test_each_form_is_measured_and_the_outputs_agree():
    out = measure(2, 16, 128, q_heads=4, kv_heads=2, head_dim=32, dtype=mx.float32)
    assert out["broadcast_mask_bytes"] == 2 * 4 * 16 * 128 * 4
    for form in ("boolean", "additive", "causal"):
        assert out[form]["ms"] > 0 and out[form]["peak_over_inputs_bytes"] >= 0
    assert out["boolean_vs_additive_max_abs"] == 0.0
