"""Attention kernels: the public entry (dispatch.py: kernels.attention, the custom op and the
registry's attention implementations) and one file per kernel with its configs and launcher:
flash.py (16-bit flash attention), short_kv.py (few keys), fp8.py (FP8 Q.K), fp8_full.py and
gluon_hopper.py (full FP8, with fp8_quant.py's quantisation), gluon_hopper_bf16.py, int8.py
(with int8_quant.py), ref.py (float32 reference), checks.py (the one input check) and
sequence_parallel.py (one sequence over several GPUs)."""
