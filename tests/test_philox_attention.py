"""Attention's dropout convention (Philox v3, fastformer/philox.py): the reference's bytes against
a per-element computation from the definition, the threshold, the realised rate and the scale."""
import random

import pytest
import torch

from fastformer import philox


def _byte_by_hand(shape, seed, offset, idx):
    """Element idx = (..., i, j)'s byte, from the definition: its tile's counter, lane and byte."""
    *lead, Sq, Sk = shape
    *lead_idx, i, j = idx
    bh = 0
    for n, x in zip(lead, lead_idx):
        bh = bh * n + x
    QB, KB = -(-Sq // 16), -(-Sk // 32)
    qb, r = divmod(i, 16)
    kb, c = divmod(j, 32)
    lane, byte = 4 * (r % 8) + (c % 8) // 2, 4 * (c // 8) + 2 * (r // 8) + c % 2
    word = int(philox.philox4x32(1, seed, offset + ((bh * QB + qb) * KB + kb) * 32 + lane)[0, byte // 4])
    return (word >> (8 * (byte % 4))) & 0xFF


@pytest.mark.parametrize("shape,seed,offset", [((2, 3, 37, 70), 123456789, 77), ((1, 1, 1, 1), 5, 0),
                                               ((5, 16, 32), 2**40 + 3, 2**33 - 5), ((1, 1, 17, 1023), 9, 31)])
def test_attention_random8_matches_the_definition(shape, seed, offset):
    got = philox.attention_random8(shape, seed, offset)
    assert got.shape == shape and got.dtype == torch.int64
    rnd = random.Random(0)
    for _ in range(200):
        idx = tuple(rnd.randrange(n) for n in shape)
        assert int(got[idx]) == _byte_by_hand(shape, seed, offset, idx), idx


def test_a_lane_holds_its_accumulator_elements():
    """Lane l's 16 bytes are rows l // 4 and l // 4 + 8, columns 8 t + 2 (l % 4) + e of the tile:
    bit 4 t + 2 hi + e of ff_attn_dropout_keep16 (the mma.sync m16n8 accumulator layout)."""
    seed, offset = 17, 1000
    tile = philox.attention_random8((16, 32), seed, offset)
    for lane in (0, 5, 31):
        w = philox.philox4x32(1, seed, offset + lane)[0].tolist()
        for t in range(4):
            for hi in range(2):
                for e in range(2):
                    b = 4 * t + 2 * hi + e
                    assert int(tile[8 * hi + lane // 4, 8 * t + 2 * (lane % 4) + e]) == (w[b // 4] >> (8 * (b % 4))) & 0xFF


def test_tiles_of_a_head_row_are_independent_of_the_other_dimensions():
    """A head-row's tiles take counters offset + bh * QB * KB * 32 + ...: the (B, H, Sq, Sk) bytes of
    head-row bh are those of a (Sq, Sk) call at that offset (what the varlen op relies on)."""
    shape, seed, offset = (2, 2, 20, 40), 3, 8
    whole = philox.attention_random8(shape, seed, offset).reshape(4, 20, 40)
    per = philox.attention_counters_used((20, 40))
    assert per == 2 * 2 * 32
    for bh in range(4):
        assert torch.equal(whole[bh], philox.attention_random8((20, 40), seed, offset + bh * per))
    assert philox.attention_counters_used(shape) == 4 * per


@pytest.mark.parametrize("p,T", [(0.0, 0), (0.1, 26), (0.5, 128), (1 / 512, 1), (0.0019, 0), (0.999, 256)])
def test_threshold_rate_and_scale(p, T):
    assert philox.attention_threshold(p) == T
    assert philox.attention_drop_rate(p) == T / 256
    # unbiased: keep probability times the scale is exactly 1 (or nothing kept at all)
    assert philox.attention_keep_scale(p) * (256 - T) / 256 == (1.0 if T < 256 else 0.0)


def test_keep_rate_over_many_draws():
    """The kept share is 1 - T / 256 within 5 standard errors (4 M decisions)."""
    p = 0.1
    keep = philox.attention_keep_mask((64, 256, 256), p, 2024, 0)
    want = 1 - philox.attention_drop_rate(p)
    se = (want * (1 - want) / keep.numel()) ** 0.5
    assert abs(keep.double().mean().item() - want) < 5 * se
    bytes_ = philox.attention_random8((64, 256, 256), 2024, 0)
    counts = torch.bincount(bytes_.flatten(), minlength=256).double()
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()  # bytes are uniform
