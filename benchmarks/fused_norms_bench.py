"""The fused-norm kernels on a GPU, beside what ComfyUI runs for the same work (Wan 2.1 and Flux
shapes):

- layer_norm_modulate vs torch's LayerNorm then addcmul(shift, norm, 1 + scale) (Wan's block);
- rms_norm_rope vs torch's rms_norm then RoPE: comfy-kitchen's apply_rope1 where it is
  importable (what ComfyUI 0.29 runs with comfy-kitchen's CUDA backend), and ComfyUI's eager
  _apply_rope1 written out in torch (what it runs without);
- qk_rms_norm vs torch's rms_norm on Flux's permuted q and k views (copy + norm, twice);
- gated_residual_layer_norm vs addcmul(x, y, e[2]) then norm3's affine LayerNorm, and
  gated_residual vs the block's last addcmul(x, y, e[5]) (Wan's block).

    python benchmarks/fused_norms_bench.py [--out DIR] [--shapes wan14b,wan1.3b]

Random bf16 activations with outlier channels; `triton.testing.do_bench` medians; effective
bandwidth counts what a single pass must move (one read and one write of the activation; four
activations for the residual + LayerNorm, three for the gated residual) for every variant of an
op, so the ratio of times and of "GB/s" is the same. Accuracy: bit-identical share
and rel. L2 of ours against the torch sequence. Prints the table last; writes fused_norms.json.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import load_pack  # noqa: E402

pack = load_pack()
lnm = importlib.import_module(pack.__name__ + ".kernels.fused.layer_norm_modulate")
nr = importlib.import_module(pack.__name__ + ".kernels.fused.norm_rope")
qkn = importlib.import_module(pack.__name__ + ".kernels.fused.qk_norm")
grn = importlib.import_module(pack.__name__ + ".kernels.fused.gated_residual_norm")

# name -> (tokens, heads, head_dim): Wan 2.1 14B at 480p x 81 frames, 1.3B at the same size;
# Flux at 1024x1024 (4096 image tokens; the QK norm alone: Flux's blocks are not Wan's).
SHAPES = {"wan14b": (32760, 40, 128), "wan1.3b": (32760, 12, 128), "flux": (4096, 24, 128)}


def comfy_freqs(tokens: int, head_dim: int, device) -> torch.Tensor:
    pos = torch.arange(tokens, dtype=torch.float64, device=device)[None, :]
    scale = torch.linspace(0, (head_dim - 2) / head_dim, steps=head_dim // 2, dtype=torch.float64, device=device)
    out = torch.einsum("...n,d->...nd", pos, 1.0 / (10000 ** scale))
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(1, tokens, 1, head_dim // 2, 2, 2).float()


def eager_rope(x, freqs):
    x_ = x.to(freqs.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    out = freqs[..., 0] * x_[..., 0]
    out.addcmul_(freqs[..., 1], x_[..., 1])
    return out.reshape(*x.shape).type_as(x)


def kitchen_rope():
    try:
        import comfy_kitchen

        return comfy_kitchen.apply_rope1
    except Exception as e:  # not installed, or no CUDA backend for this torch
        return f"{type(e).__name__}: {e}"[:200]


def compare(ours, ref) -> dict:
    o, r = ours.float(), ref.float()
    return {"identical": round((ours == ref).float().mean().item(), 5),
            "rel_l2": (o - r).norm().item() / max(r.norm().item(), 1e-30)}


def run_shape(name, tokens, heads, head_dim, device, bench):
    c = heads * head_dim
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, tokens, c, device=device, generator=g) * 2 + 0.3
    x[..., :: 97] *= 25  # outlier channels
    x = x.to(torch.bfloat16)
    e = (torch.randn(1, 6, c, device=device, generator=g) * 0.3).to(torch.bfloat16).chunk(6, dim=1)
    weight = (torch.rand(c, device=device, generator=g) + 0.5).to(torch.bfloat16)
    freqs = comfy_freqs(tokens, head_dim, device)
    moved = 2 * x.numel() * x.element_size()
    rows = []

    def row(op, variant, fn, reference=None, passes=2):
        ms = bench(fn)
        entry = dict(shape=name, op=op, variant=variant, ms=ms, gb_s=passes * moved / 2 / ms / 1e6)
        if reference is not None:
            entry.update(compare(fn(), reference))
        rows.append(entry)
        return entry

    # Flux's QKNorm: q and k as permuted views of the qkv Linear's output, each normalised per
    # head by torch's rms_norm (which copies the strided view first) or by ours in one launch.
    qkv = torch.randn(1, tokens, 3 * c, device=device, generator=g).to(torch.bfloat16)
    q, k, _v = qkv.view(1, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    wq, wk = weight[:head_dim], weight[head_dim:2 * head_dim]
    qk_moved = 4 * q.numel() * q.element_size()

    def torch_qk():
        return (torch.nn.functional.rms_norm(q, (head_dim,), wq), torch.nn.functional.rms_norm(k, (head_dim,), wk))

    ref_q, _ = torch_qk()
    for variant, fn in (("torch rms_norm x2 (ComfyUI)", torch_qk),
                        ("ours fused", lambda: qkn.qk_rms_norm(q, k, wq, wk, torch.finfo(torch.float32).eps))):
        ms = bench(fn)
        entry = dict(shape=name, op="qk_norm (Flux)", variant=variant, ms=ms, gb_s=qk_moved / ms / 1e6)
        if variant.startswith("ours"):
            entry.update(compare(fn()[0], ref_q))
        rows.append(entry)
    if name == "flux":
        return rows

    def torch_ln_mod():
        return torch.addcmul(e[0], torch.nn.functional.layer_norm(x, (c,), eps=1e-6), 1 + e[1])

    ref = torch_ln_mod()
    row("layernorm+modulate", "torch (ComfyUI)", torch_ln_mod)
    row("layernorm+modulate", "ours fused", lambda: lnm.layer_norm_modulate(x, e[0], e[1], 1e-6), ref)

    def torch_rms(v):
        return torch.nn.functional.rms_norm(v, (c,), weight, 1e-6)

    q_view = (1, tokens, heads, head_dim)
    ref = eager_rope(torch_rms(x).view(q_view), freqs).view(1, tokens, c)
    row("rmsnorm+rope", "torch rms_norm + eager rope (ComfyUI w/o comfy-kitchen)",
        lambda: eager_rope(torch_rms(x).view(q_view), freqs))
    kitchen = kitchen_rope()
    if callable(kitchen):
        row("rmsnorm+rope", "torch rms_norm + comfy-kitchen rope (ComfyUI default)",
            lambda: kitchen(torch_rms(x).view(q_view), freqs))
    else:
        rows.append(dict(shape=name, op="rmsnorm+rope", variant="comfy-kitchen rope", error=kitchen))
    row("rmsnorm+rope", "ours fused", lambda: nr.rms_norm_rope(x, weight, freqs, 1e-6, head_dim), ref)
    # The same kernel with the row in one padded power-of-two block (8192 lanes for 5120 channels).
    row("rmsnorm+rope", "ours fused, one padded block",
        lambda: nr._launch(x, weight, freqs, 1e-6, head_dim, split=False), ref)

    # After the self-attention: x = addcmul(x, y, e[2]) then norm3(x) (affine LayerNorm), what
    # the cross-attention reads; a single pass must read x and y and write x and norm3(x).
    y = (torch.randn(1, tokens, c, device=device, generator=g) * 0.5).to(torch.bfloat16)
    bias = (torch.randn(c, device=device, generator=g) * 0.1).to(torch.bfloat16)

    def torch_residual_norm3():
        h = torch.addcmul(x, y, e[2])
        return h, torch.nn.functional.layer_norm(h, (c,), weight, bias, 1e-6)

    ref = torch_residual_norm3()[1]
    row("residual+layernorm", "torch addcmul + layer_norm (ComfyUI)", torch_residual_norm3, passes=4)
    row("residual+layernorm", "ours fused",
        lambda: grn.gated_residual_layer_norm(x, y, e[2], 1e-6, weight, bias), passes=4)
    rows[-1].update(compare(grn.gated_residual_layer_norm(x, y, e[2], 1e-6, weight, bias)[1], ref))
    # The block's last op: addcmul(x, y, e[5]) (reads x and y, writes x).
    ref = torch.addcmul(x, y, e[5])
    row("gated residual", "torch addcmul (ComfyUI)", lambda: torch.addcmul(x, y, e[5]), passes=3)
    row("gated residual", "ours", lambda: grn.gated_residual(x, y, e[5]), ref, passes=3)
    # norm2 after the cross-attention: x + y, then LayerNorm + modulation, and (e4m3 rows) what
    # the FFN's FP8 Linear reads: before the fused pass torch's add, our LayerNorm + modulation and
    # the Linear's own quantisation; now one pass writing x, the output and its e4m3 rows.
    lf = importlib.import_module(pack.__name__ + ".kernels.linear.fp8")

    def before_norm2():
        h = x + y
        out = lnm.layer_norm_modulate(h, e[3], e[4], 1e-6)
        return h, out, lf.quantize_activation(out.view(-1, c))

    ref = torch.addcmul(e[3], torch.nn.functional.layer_norm(x + y, (c,), eps=1e-6), 1 + e[4])
    row("residual+layernorm+modulate (+e4m3 rows)", "torch add + ours LN-mod + FP8 Linear's quantisation",
        before_norm2, passes=5)
    row("residual+layernorm+modulate (+e4m3 rows)", "ours, one pass",
        lambda: lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=y), passes=4)
    rows[-1].update(compare(lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=y)[1], ref))
    row("residual+layernorm+modulate (+e4m3 rows)", "ours, one pass with e4m3 rows",
        lambda: lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=y, fp8_rows=True), passes=5)
    _, out, rows8 = lnm.residual_layer_norm_modulate(x, e[3], e[4], 1e-6, residual=y, fp8_rows=True)
    q8, s8 = lf.quantize_activation(out.view(-1, c))
    rows[-1]["rows_equal_linear_quantisation"] = bool(torch.equal(rows8[0].view(torch.uint8), q8.view(torch.uint8))
                                                      and torch.equal(rows8[1], s8))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    import triton

    device = torch.device("cuda")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=args.rep)

    rows = []
    for name in args.shapes.split(","):
        try:
            rows += run_shape(name, *SHAPES[name], device, bench)
        except Exception as e:
            rows.append(dict(shape=name, error=f"{type(e).__name__}: {e}"[:300]))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fused_norms.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), indent=1))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    print("shape | op | variant | ms | GB/s (what one pass must move) | vs first | identical | rel L2")
    first = {}
    for r in rows:
        if "error" in r:
            print(f"{r.get('shape')} | {r.get('op', '')} | {r.get('variant', '')} | error: {r['error']}")
            continue
        base = first.setdefault((r["shape"], r["op"]), r["ms"])
        print(f"{r['shape']} | {r['op']} | {r['variant']} | {r['ms']:.4f} | {r['gb_s']:.0f} | {base / r['ms']:.2f}x | "
              f"{r.get('identical', '')} | {r.get('rel_l2', '')}"
              + (f" | e4m3 rows = the Linear's: {r['rows_equal_linear_quantisation']}"
                 if "rows_equal_linear_quantisation" in r else ""))


if __name__ == "__main__":
    main()
