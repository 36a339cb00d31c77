"""Built-in recipe for Qwen3.5-MoE (`qwen3_5_moe`, any size): the dense recipe with a routed MoE
MLP in every layer. Per-expert checkpoint keys are stacked into `mlp.experts.gate_up_proj`
[E, 2I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]; already-fused keys
are taken as they are."""

from ninfer.artifact.recipes.qwen3_5 import Qwen3_5Recipe

RECIPE = Qwen3_5Recipe("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), moe=True)
