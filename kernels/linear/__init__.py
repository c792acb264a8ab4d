"""Linear kernels: the public entry (dispatch.py: kernels.linear, prepared weights and the
custom ops) and one file per method: fp8.py (FP8 W8A8), fp8_weight_only.py, int8.py (INT8 W8A8
with a block-Hadamard rotation), cat_fp8_rows.py (a concatenation that writes the FP8 Linear's
rows) and ref.py (float32 references)."""
