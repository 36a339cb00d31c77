"""The mma.sync GEMV's host side on the CPU: the fragment-major planes and the launch
settings (the kernel itself runs only on a GPU: tests/gpu/test_groupwise_mma_gpu.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


def test_fragment_major_puts_each_lanes_words_together():
    """Lane (g, q) of a tile group finds at 16 * (4g + q) rows g and g + 8's words 2q, 2q + 1,
    row g's first; the scales are the tile's 16 rows per group."""
    from ninfer.kernels.groupwise_mma_triton import fragment_major
    from ninfer.quant import get_format

    encoded = get_format("q4_g64_fp16").encode(torch.randn(48, 64 * 5))
    codes, scales = encoded.planes["codes"], encoded.planes["scales"]
    frag, frag_scales = fragment_major(codes, scales)
    words = codes.view(torch.int32)
    assert frag.shape == (3, 5, 128) and frag_scales.shape == (3, 5, 16)
    for tile in range(3):
        for group in range(5):
            for g in range(8):
                for q in range(4):
                    for rep in range(2):
                        for t in range(2):
                            stored = words[tile * 16 + rep * 8 + g, group * 8 + 2 * q + t]
                            assert frag[tile, group, 16 * g + 4 * q + 2 * rep + t] == stored
            assert torch.equal(frag_scales[tile, group], scales[tile * 16 : tile * 16 + 16, group])


@pytest.mark.parametrize("n", [16, 48, 5120, 34816])
@pytest.mark.parametrize("num_groups", [1, 7, 80, 272])
def test_the_splits_cover_every_group_once(n, num_groups):
    from ninfer.kernels import groupwise_mma_triton as gm

    tiles, warps, splits, per_split = gm.launch_config(n, num_groups, 132)
    assert (n // 16) % tiles == 0 and splits >= 1
    assert per_split % (warps * gm.SLOTS) == 0
    assert (splits - 1) * per_split < num_groups <= splits * per_split
