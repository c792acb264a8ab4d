"""Fused norm and rotary-embedding passes of DiT blocks, one op per file: qk_norm.py and
qk_norm_rope.py (Flux's per-head QK RMSNorm, with RoPE), norm_rope.py (Wan's whole-row RMSNorm
and RoPE), layer_norm_modulate.py (LayerNorm + shift/scale) and gated_residual_norm.py
(x + y * gate, optionally followed by a LayerNorm)."""
