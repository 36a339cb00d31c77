"""The causal conv fed in pieces, with its window carried in a state slot, equals one
zero-padded causal depthwise conv + SiLU over the whole sequence."""

import torch
import torch.nn.functional as F

from ninfer.kernels.causal_conv1d import causal_conv1d

CHANNELS, WIDTH = 10, 4


def whole_sequence_conv(x, weight):
    """silu(y), y[t, c] = sum_j w[c, j] x[t - K + 1 + j, c], zeros before the start."""
    padded = torch.cat([torch.zeros(WIDTH - 1, CHANNELS), x])
    y = torch.stack([(padded[t : t + WIDTH].T * weight).sum(-1) for t in range(x.shape[0])])
    return F.silu(y)


def test_conv_in_pieces_with_carried_window_equals_whole_sequence():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen)
    a = torch.randn(20, CHANNELS, generator=gen)
    b = torch.randn(9, CHANNELS, generator=gen)
    windows = torch.zeros(4, CHANNELS, WIDTH - 1)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    outs = {0: [], 1: []}
    # sequence 0 in pieces of 2, 1, 17 tokens; sequence 1 in 9 single-token (decode) steps,
    # batched with sequence 0 while both have tokens
    pieces_a = [(0, 2), (2, 3), (3, 20)]
    for step in range(9):
        xs, lens, seqs = [], [], []
        if step < len(pieces_a):
            xs.append(a[slice(*pieces_a[step])])
            lens.append(pieces_a[step][1] - pieces_a[step][0])
            seqs.append(0)
        xs.append(b[step : step + 1])
        lens.append(1)
        seqs.append(1)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        out = causal_conv1d(torch.cat(xs), weight, windows, slots[seqs], starts)
        for i, seq in enumerate(seqs):
            outs[seq].append(out[starts[i] : starts[i + 1]])
    assert torch.allclose(torch.cat(outs[0]), whole_sequence_conv(a, weight), atol=1e-5)
    assert torch.allclose(torch.cat(outs[1]), whole_sequence_conv(b, weight), atol=1e-5)
    assert torch.equal(windows[3], a[-(WIDTH - 1) :].T)
    assert torch.equal(windows[0], torch.zeros(CHANNELS, WIDTH - 1))
