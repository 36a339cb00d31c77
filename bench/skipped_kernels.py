"""What a kind of small kernel costs a decode step: `ninfer bench` with that kernel's calls
skipped. Under PDL a kernel's time in `--profile` (run without graphs) includes its wait for
the kernel before it, so the profile cannot say what removing a kernel would save; timing the
step without it can. The skipped call returns its input, or an empty tensor of its output's
shape, so the tokens are wrong: read only the timing.

    python bench/skipped_kernels.py KIND[,KIND] -- <ninfer bench arguments>
    python bench/skipped_kernels.py gates -- --shape qwen3_5-27b --weights q4 -n 48 --concurrency 8 -r 2

KIND: gates (the GDN gates kernel: its own launch, or its programs in the conv's kernel),
conv (the GDN causal conv), gatednorm (the GDN gated norm), norm (every RMS norm, the residual
adds with them), swiglu (the dense MLP's SwiGLU; where it runs in the gate|up product's
epilogue, that product runs plain), none. docs/performance.md, Measurement 24.
"""

from __future__ import annotations

import sys

import torch

from ninfer.cli.main import main
from ninfer.models.layers import gated_deltanet, mlp, norms

KINDS = ("gates", "conv", "gatednorm", "norm", "swiglu", "none")


def _empty_gates(x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.empty(x.shape[0], heads, dtype=torch.float32, device=x.device)
    return g, torch.empty(x.shape[0], heads, dtype=x.dtype, device=x.device)


def skip(kinds: set[str]) -> None:
    """Replace the calls of each kind in the model's modules by no kernel at all."""
    if "gates" in kinds:
        gated_deltanet.GatedDeltaNet.gates = lambda self, x: _empty_gates(x, self.num_value_heads)

        def conv_without_gates(x, weight, windows, slots, query_start, ba_x, w_ba, *rest):
            conv = gated_deltanet.causal_conv1d(x, weight, windows, slots, query_start)
            return (conv, *_empty_gates(ba_x, w_ba.shape[0] // 2))

        gated_deltanet.causal_conv1d_and_gates = conv_without_gates
    if "conv" in kinds:
        gated_deltanet.causal_conv1d = lambda x, weight, windows, slots, query_start: x
        if "gates" not in kinds:

            def gates_without_conv(x, weight, windows, slots, query_start, ba_x, w_ba, *rest):
                return (x, *gated_deltanet.gdn_gates_from_x(ba_x, w_ba, *rest))

            gated_deltanet.causal_conv1d_and_gates = gates_without_conv
    if "gatednorm" in kinds:
        norms.GatedRMSNorm.forward = lambda self, x, z: x
    if "norm" in kinds:
        norms.RMSNorm.forward = lambda self, x, residual=None: (
            x if residual is None else (x, residual)
        )
    if "swiglu" in kinds:
        mlp.takes_swiglu_linear = lambda x, weight: False
        mlp.silu_mul = lambda gate, up, split=None: gate


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or args[1] != "--":
        sys.exit(__doc__)
    kinds = set(args[0].split(","))
    unknown = kinds - set(KINDS)
    if unknown:
        sys.exit(
            f"skipped_kernels: unknown kind {sorted(unknown)[0]!r} (one of {', '.join(KINDS)})"
        )
    skip(kinds)
    print(f"skipped: {', '.join(sorted(kinds))}", file=sys.stderr)
    sys.exit(main(["bench", *args[2:]]))
