"""Accuracy against float32 shared by the GPU benchmarks: cosine and rel. L2 of an output, and
the float32 attention reference computed in query chunks (a Wan head's scores are 4.3 GB)."""
import torch


def metrics(out, ref) -> dict:
    """{cos, rel_l2} of `out` against `ref`, both flattened in float32; NaN where out is not finite."""
    o, r = out.float().flatten(), ref.float().flatten()
    if not torch.isfinite(o).all():
        return dict(cos=float("nan"), rel_l2=float("nan"))
    return dict(cos=torch.nn.functional.cosine_similarity(o, r, dim=0).item(),
                rel_l2=((o - r).norm() / r.norm().clamp_min(1e-30)).item())


def reference(q, k, v, chunk=4096):
    """float32 softmax(q k^T / sqrt(d)) v for [B, H, L, D] inputs (K / V heads repeated for GQA),
    `chunk` query rows at a time."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    kt, vf, scale = k.float().transpose(-1, -2), v.float(), q.shape[-1] ** -0.5
    for i in range(0, q.shape[-2], chunk):
        p = torch.softmax(torch.matmul(q[..., i:i + chunk, :].float(), kt) * scale, dim=-1)
        out[..., i:i + chunk, :] = torch.matmul(p, vf)
    return out
