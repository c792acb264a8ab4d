"""runtime/fused_norms.py (and fused_block_patch, fused_wan, fused_flux) without ComfyUI: which blocks it patches, which calls it serves,
its first-call guard, torch.compile tracing and MultiGPU clones.

The Wan classes below restate, for these tests only, the structure and math the patch relies on
(a block with modulation, LayerNorms without affine, a self-attention with RMSNorm q/k and
RoPE); the real ComfyUI classes are exercised by tests/integration/test_fused_norms.py (0.29.0
and 0.3.64). Their forward globals provide what ComfyUI's module does: `comfy.model_management
.cast_to` and `optimized_attention`.
"""
from __future__ import annotations

import types

import pytest
import torch

from triton_accel.runtime import call_stats
from triton_accel.kernels.core import env_settings
from triton_accel.runtime import fused_block_patch, fused_flux, fused_norms, fused_wan, linear_layer

C, HEADS, HEAD_DIM, TOKENS = 64, 2, 32, 6


def _cast_to(t, dtype=None, device=None):
    return t.to(dtype=dtype, device=device)


comfy = types.SimpleNamespace(model_management=types.SimpleNamespace(cast_to=_cast_to))


def optimized_attention(q, k, v, heads, transformer_options=None):
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, s, -1)


def rope(x, freqs):
    x_ = x.to(freqs.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    return (freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


class WanSelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HEAD_DIM
        self.q, self.k, self.v, self.o = (torch.nn.Linear(C, C) for _ in range(4))
        self.norm_q, self.norm_k = torch.nn.RMSNorm(C, eps=1e-6), torch.nn.RMSNorm(C, eps=1e-6)
        with torch.no_grad():
            self.norm_q.weight.uniform_(0.5, 1.5)
            self.norm_k.weight.uniform_(0.5, 1.5)

    def forward(self, x, freqs, transformer_options={}):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = rope(self.norm_q(self.q(x)).view(b, s, n, d), freqs)
        k = rope(self.norm_k(self.k(x)).view(b, s, n, d), freqs)
        return self.o(optimized_attention(q.view(b, s, -1), k.view(b, s, -1), self.v(x), heads=n))


class CrossAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(C, C)

    def forward(self, x, context, context_img_len=None, transformer_options={}):
        return self.q(x) * 0.1 + context.mean(dim=1, keepdim=True)


class WanAttentionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dim = C
        self.norm1 = torch.nn.LayerNorm(C, 1e-6, elementwise_affine=False)
        self.norm2 = torch.nn.LayerNorm(C, 1e-6, elementwise_affine=False)
        self.norm3 = torch.nn.LayerNorm(C, 1e-6)
        with torch.no_grad():  # not the identity affine a fresh LayerNorm has
            self.norm3.weight.uniform_(0.5, 1.5)
            self.norm3.bias.uniform_(-0.5, 0.5)
        self.self_attn = WanSelfAttention()
        self.cross_attn = CrossAttention()
        self.ffn = torch.nn.Sequential(torch.nn.Linear(C, 2 * C), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(2 * C, C))
        self.modulation = torch.nn.Parameter(torch.randn(1, 6, C) / C ** 0.5)

    def forward(self, x, e, freqs, context, context_img_len=257, transformer_options={}):
        if e.ndim < 4:
            e = (comfy.model_management.cast_to(self.modulation, dtype=x.dtype, device=x.device) + e).chunk(6, dim=1)
        else:
            e = (comfy.model_management.cast_to(self.modulation, dtype=x.dtype, device=x.device).unsqueeze(0)
                 + e).unbind(2)
        y = self.self_attn(torch.addcmul(e[0], self.norm1(x), 1 + e[1]), freqs, transformer_options=transformer_options)
        x = torch.addcmul(x, y, e[2])
        x = x + self.cross_attn(self.norm3(x), context, context_img_len=context_img_len,
                                transformer_options=transformer_options)
        y = self.ffn(torch.addcmul(e[3], self.norm2(x), 1 + e[4]))
        return torch.addcmul(x, y, e[5])


for _cls in (WanSelfAttention, WanAttentionBlock):
    _cls.__module__ = fused_block_patch.WAN_MODULE


class VaceBlock(WanAttentionBlock):  # a subclass with its own forward (VACE): never patched
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


VaceBlock.__module__ = fused_block_patch.WAN_MODULE


class Diffusion(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)


class FakePatcher:
    """What the patch uses of ComfyUI's ModelPatcher: object patches by key, get_model_object
    returning the patch (or the model's own attribute), callbacks by key."""

    def __init__(self, diffusion_model):
        self.model = types.SimpleNamespace(diffusion_model=diffusion_model)
        self.object_patches = {}
        self.callbacks = {}

    def get_model_object(self, key):
        if key in self.object_patches:
            return self.object_patches[key]
        obj = self.model
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    def add_object_patch(self, key, obj):
        self.object_patches[key] = obj

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)


def freqs_for(tokens=TOKENS):
    angles = torch.rand(1, tokens, 1, HEAD_DIM // 2) * 6
    return torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).reshape(
        1, tokens, 1, HEAD_DIM // 2, 2, 2)


def block_call(batch=1, e_dims=4, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(batch, TOKENS, C, dtype=dtype) * 2
    e = torch.randn(batch, 1, 6, C, dtype=dtype) * 0.3 if e_dims == 4 else torch.randn(batch, 6, C, dtype=dtype) * 0.3
    return dict(x=x, e=e, freqs=freqs_for(), context=torch.randn(batch, 5, C, dtype=dtype), context_img_len=None,
                transformer_options={})


@pytest.fixture(autouse=True)
def _stats():
    call_stats.reset()
    yield


def _patched(blocks=None):
    torch.manual_seed(1)
    blocks = blocks if blocks is not None else [WanAttentionBlock(), WanAttentionBlock()]
    patcher = FakePatcher(Diffusion(blocks))
    assert fused_norms.patch_fused_norms(patcher, "Wan #test") == sum(fused_wan.fusable_block(b) is None for b in blocks)
    return patcher, blocks


def _norms():
    return call_stats.snapshot()["kinds"].get("norms", {"served": 0, "handed_back": 0, "reasons": {}})


@pytest.mark.parametrize("e_dims", [3, 4], ids=["comfyui_0.3_e", "comfyui_0.4_e"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_block_matches_the_original_and_is_served(e_dims, batch):
    patcher, blocks = _patched()
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    call = block_call(batch, e_dims)
    ref = blocks[0].forward(**call)
    first = patch(**call)  # the guard: ComfyUI's output, ours compared with it
    second = patch(**call)
    assert torch.equal(first, ref)
    assert ((second - ref).norm() / ref.norm()).item() < 1e-5
    assert _norms()["served"] == 2 and _norms()["handed_back"] == 0, _norms()
    assert patch.guarded == {"cpu"} and not patch.fallbacks


@pytest.mark.parametrize("norm3", ["layer_norm_affine", "layer_norm_plain", "identity", "other_norm"])
def test_gated_residual_and_norm3_fused_where_known(monkeypatch, norm3):
    """The residual after the self-attention and norm3 of it run as one kernel when norm3 is a
    LayerNorm over the channels (Wan's cross_attn_norm) or an Identity (without it); another
    norm runs as it is on the fused residual. The block's last residual is always ours."""
    calls = []
    for name in ("gated_residual", "gated_residual_layer_norm", "gated_residual_layer_norm_rows"):
        real, label = getattr(fused_wan, name), name.removesuffix("_rows")  # with or without e4m3 rows
        monkeypatch.setattr(fused_wan, name, (lambda real, label: lambda *a, **k: calls.append(label) or real(*a, **k))(real, label))
    torch.manual_seed(1)
    block = WanAttentionBlock()
    if norm3 == "layer_norm_plain":
        block.norm3 = torch.nn.LayerNorm(C, 1e-5, elementwise_affine=False)
    elif norm3 == "identity":
        block.norm3 = torch.nn.Identity()
    elif norm3 == "other_norm":
        block.norm3 = torch.nn.RMSNorm(C, eps=1e-6)
    patcher, blocks = _patched([block])
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    call = block_call(2, 3)
    ref = blocks[0].forward(**call)
    patch(**call)  # the guard's call
    calls.clear()
    out = patch(**call)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    fused = norm3 in ("layer_norm_affine", "layer_norm_plain")
    assert calls == (["gated_residual_layer_norm", "gated_residual"] if fused else ["gated_residual"] * 2), calls
    assert _norms()["served"] == 2 and _norms()["handed_back"] == 0, _norms()


def _recording_scopes(monkeypatch, used: int):
    """fused_block_patch.quantize_once replaced by a recorder: [(x, rows)] per block entered, the modules
    called inside one; `used` is what each block reports as GEMMs that read its rows."""
    import contextlib

    scopes, inside = [], []

    @contextlib.contextmanager
    def recording(x, rows=None):
        scopes.append((x, rows))
        inside.append(True)
        try:
            yield types.SimpleNamespace(used=used)
        finally:
            inside.pop()

    monkeypatch.setattr(fused_block_patch, "quantize_once", recording)  # the norm passes' rows
    monkeypatch.setattr(fused_wan, "quantize_once", recording)  # Wan's q/k/v Linears
    return scopes, inside


def test_linears_after_the_norms_read_the_norm_kernels_fp8_rows(monkeypatch):
    """The Linears that read a fused norm's output run inside linear_fp8.quantize_once(x, rows):
    q, k and v (one activation, quantised once for the three), the cross-attention's q (norm3)
    and the FFN's first Linear (norm2), each with the e4m3 rows the norm kernel wrote beside x,
    bit for bit what the FP8 Linear's own quantisation makes of x. The self-attention's o runs
    outside; the FFN's second Linear inside the FFN's block, on another tensor (it quantises its
    own input)."""
    from triton_accel.kernels.linear import fp8 as linear_fp8

    scopes, inside = _recording_scopes(monkeypatch, used=1)
    patcher, blocks = _patched([WanAttentionBlock()])
    block = blocks[0]
    modules = {"q": block.self_attn.q, "k": block.self_attn.k, "v": block.self_attn.v, "o": block.self_attn.o,
               "cross_q": block.cross_attn.q, "ffn0": block.ffn[0], "ffn2": block.ffn[2]}
    seen = {}
    for name, module in modules.items():
        module.register_forward_hook(
            (lambda name: lambda m, args, out: seen.setdefault(name, []).append((args[0], bool(inside))))(name))
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    call = block_call(1, 3)
    patch(**call)  # the guard's call
    seen.clear()
    scopes.clear()
    patch(**call)
    assert len(scopes) == 3
    for (x, rows), names in zip(scopes, (("q", "k", "v"), ("cross_q",), ("ffn0",))):
        for name in names:
            (read, scoped), = seen[name]
            assert scoped and read is x, name
        q, scales = linear_fp8.quantize_activation(x.reshape(-1, C))
        assert torch.equal(rows[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows[1], scales), names
    (_, scoped), = seen["o"]
    assert not scoped
    (read, _), = seen["ffn2"]
    assert read is not scopes[2][0]


def test_rows_stop_where_no_gemm_reads_them(monkeypatch):
    """A site whose rows no GEMM read (its Linear is not our FP8 one) stops getting them after
    FP8_ROWS_MISSES calls: the norm kernels then write the 16-bit output only. q, k and v still
    share one quantisation scope."""
    scopes, _ = _recording_scopes(monkeypatch, used=0)
    patcher, _ = _patched([WanAttentionBlock()])
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    call = block_call(1, 3)
    for _ in range(fused_block_patch.FP8_ROWS_MISSES):
        scopes.clear()
        patch(**call)
        assert len(scopes) == 3 and all(rows is not None for _, rows in scopes)
    scopes.clear()
    patch(**call)
    assert len(scopes) == 1 and scopes[0][1] is None
    assert patch.fp8_rows_misses == {site: fused_block_patch.FP8_ROWS_MISSES for site in ("qkv", "cross_q", "ffn")}


def test_guard_sends_a_block_that_disagrees_back_for_good():
    patcher, blocks = _patched()
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    original = patch.previous
    patch.previous = lambda *a, **k: original(*a, **k) * 1.05  # "ComfyUI's block" computes something else
    call = block_call()
    first = patch(**call)
    assert torch.equal(first, original(**call) * 1.05)
    assert "cpu" in patch.fallbacks and "rel. L2" in patch.fallbacks["cpu"]
    patch(**call)
    assert _norms()["served"] == 0 and _norms()["reasons"] == {fused_block_patch.REASON_FALLBACK: 2}, _norms()


@pytest.mark.parametrize("agrees", [True, False])
def test_one_check_per_model_and_device_covers_every_block(agrees):
    """The blocks share one Guard: the first block called is compared with ComfyUI's forward,
    the others follow its outcome without running a reference (a second forward of a Wan 14B
    block costs its attention and MLP again)."""
    patcher, blocks = _patched()
    first, other = (patcher.object_patches[f"diffusion_model.blocks.{i}.forward"] for i in (0, 1))
    assert first.guard is other.guard
    if not agrees:
        original = first.previous
        first.previous = lambda *a, **k: original(*a, **k) * 1.05
    ran = []
    reference = other.previous
    other.previous = lambda *a, **k: ran.append(1) or reference(*a, **k)
    call = block_call()
    first(**call)
    out = other(**call)
    if agrees:
        assert ran == [] and other.guarded == {"cpu"}
        assert ((out - reference(**call)).norm() / reference(**call).norm()).item() < 1e-5
        assert _norms()["served"] == 2, _norms()
    else:
        assert ran == [1] and "rel. L2" in other.fallbacks["cpu"]  # ComfyUI's forward, no check
        assert _norms()["served"] == 0 and _norms()["reasons"] == {fused_block_patch.REASON_FALLBACK: 2}, _norms()


@pytest.mark.parametrize("case,reason", [
    ("per_frame_e", "per-frame"), ("e_dtype", "modulation in"), ("attn1_patch", "attn1/attn2"),
    ("freqs_tokens", "do not match"), ("x_width", "is not [B, L")])
def test_calls_it_cannot_serve_go_to_comfyui(case, reason):
    patcher, blocks = _patched()
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    call = block_call()
    if case == "per_frame_e":
        call["e"] = torch.randn(1, TOKENS, 6, C) * 0.3  # one modulation per token (frame)
    elif case == "e_dtype":
        call["e"] = call["e"].double()
    elif case == "attn1_patch":
        call["transformer_options"] = {"patches": {"attn1_patch": [lambda a: a["x"]]}}
    elif case == "freqs_tokens":
        call["freqs"] = freqs_for(TOKENS + 1)
    elif case == "x_width":
        call["x"] = torch.randn(1, TOKENS, C + 2)
    if case in ("per_frame_e", "attn1_patch"):
        assert torch.equal(patch(**call), blocks[0].forward(**call))
    else:
        with pytest.raises(Exception):  # ComfyUI's own forward fails on these too: it was called
            patch(**call)
    norms = _norms()
    assert norms["served"] == 0 and norms["handed_back"] == 1, norms
    assert reason in next(iter(norms["reasons"])), norms


def test_traced_calls_are_comfyuis_forward(monkeypatch):
    patcher, blocks = _patched()
    patch = patcher.object_patches["diffusion_model.blocks.0.forward"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    call = block_call()
    assert torch.equal(patch(**call), blocks[0].forward(**call))
    assert _norms()["served"] == _norms()["handed_back"] == 0


def test_only_blocks_it_knows_are_patched():
    affine = WanAttentionBlock()
    affine.norm1 = torch.nn.LayerNorm(C, 1e-6)
    identity_qk = WanAttentionBlock()
    identity_qk.self_attn.norm_q = torch.nn.Identity()
    blocks = [WanAttentionBlock(), VaceBlock(), affine, identity_qk]
    assert "not ComfyUI's WanAttentionBlock" in fused_wan.fusable_block(blocks[1])
    assert "norm1" in fused_wan.fusable_block(affine)
    assert "norm_q" in fused_wan.fusable_block(identity_qk)
    patcher, _ = _patched(blocks)
    assert list(patcher.object_patches) == ["diffusion_model.blocks.0.forward"]


def test_patching_again_or_over_another_nodes_patch_changes_nothing():
    patcher, blocks = _patched()
    before = dict(patcher.object_patches)
    assert fused_norms.patch_fused_norms(patcher, "again") == 0
    assert patcher.object_patches == before
    other = FakePatcher(Diffusion([WanAttentionBlock()]))
    foreign = lambda *a, **k: None  # noqa: E731 - another node's block patch
    other.add_object_patch("diffusion_model.blocks.0.forward", foreign)
    assert fused_norms.patch_fused_norms(other, "other") == 0
    assert other.object_patches["diffusion_model.blocks.0.forward"] is foreign


def test_multigpu_clone_gets_its_own_blocks():
    patcher, blocks = _patched()
    assert fused_block_patch.CALLBACK_KEY in patcher.callbacks["on_deepclone_multigpu"]
    clone_blocks = [WanAttentionBlock(), WanAttentionBlock()]
    clone = FakePatcher(Diffusion(clone_blocks))
    clone.object_patches = dict(patcher.object_patches)
    fused_norms.on_multigpu_clone(patcher, clone)
    patch = clone.object_patches["diffusion_model.blocks.1.forward"]
    assert patch.module is clone_blocks[1] and patch.previous.__self__ is clone_blocks[1]
    assert patch.guarded == set() and patch.label == "Wan #test"
    call = block_call()
    assert torch.equal(patch(**call), clone_blocks[1].forward(**call))


@pytest.mark.parametrize("value, mode", [(None, "all"), ("1", "blocks"), ("on", "blocks"), ("blocks", "blocks"),
                                         ("all", "all"), (" ALL ", "all"), ("qk", "qk"), ("off", "off"), ("0", "off"),
                                         ("", "off")])
def test_enabled_reads_the_setting(monkeypatch, value, mode):
    """Wan blocks and Flux's QKNorms fused by default (both measured faster); "blocks" keeps
    the QKNorms ComfyUI's; "qk" fuses them but not Flux's blocks (test_flux_blocks_... below)."""
    if value is None:
        monkeypatch.delenv("TRITON_ACCEL_FUSED_NORMS", raising=False)
    else:
        monkeypatch.setenv("TRITON_ACCEL_FUSED_NORMS", value)
    assert env_settings.fused_norms() == mode
    assert fused_norms.enabled() == (mode != "off")
    patcher = FakePatcher(FluxLike("torch"))
    assert fused_norms.patch_fused_norms(patcher, "Flux #test") == (2 if mode in ("all", "qk") else 0)


# ---- Flux's QKNorm ------------------------------------------------------------------------------

class FluxRMSNorm(torch.nn.Module):  # ComfyUI 0.3.x's flux.layers.RMSNorm: a `scale`, eps 1e-6
    def __init__(self, dim):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.scale.shape, self.scale.to(x.dtype), 1e-6)


class QKNorm(torch.nn.Module):
    def __init__(self, dim, flavour="torch"):
        super().__init__()
        make = (lambda: torch.nn.RMSNorm(dim)) if flavour == "torch" else (lambda: FluxRMSNorm(dim))
        self.query_norm, self.key_norm = make(), make()
        if flavour == "torch":  # ComfyUI 0.4+: comfy.ops' RMSNorm, eps None
            with torch.no_grad():
                self.query_norm.weight.uniform_(0.5, 1.5)
                self.key_norm.weight.uniform_(0.5, 1.5)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


for _cls in (FluxRMSNorm, QKNorm):
    _cls.__module__ = fused_block_patch.FLUX_MODULE
FluxRMSNorm.__name__ = FluxRMSNorm.__qualname__ = "RMSNorm"
FluxRMSNorm.forward.__qualname__ = "RMSNorm.forward"


@pytest.fixture
def qk_norms_on(monkeypatch):
    monkeypatch.setenv("TRITON_ACCEL_FUSED_NORMS", "all")  # Flux's QKNorms are patched only then


class FluxLike(torch.nn.Module):
    def __init__(self, flavour):
        super().__init__()
        self.double_blocks = torch.nn.ModuleList([torch.nn.Module()])
        self.double_blocks[0].img_attn = torch.nn.Module()
        self.double_blocks[0].img_attn.norm = QKNorm(HEAD_DIM, flavour)
        self.single_blocks = torch.nn.ModuleList([torch.nn.Module()])
        self.single_blocks[0].norm = QKNorm(HEAD_DIM, flavour)


def qkv(batch=1, tokens=TOKENS, dtype=torch.float32):
    torch.manual_seed(2)
    x = torch.randn(batch, tokens, 3 * HEADS * HEAD_DIM, dtype=dtype) * 3
    return x.view(batch, tokens, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)


@pytest.mark.parametrize("flavour", ["torch", "flux_scale"], ids=["comfyui_0.4_rmsnorm", "comfyui_0.3_rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qk_norms_are_patched_served_and_match(flavour, dtype, qk_norms_on):
    model = FluxLike(flavour).to(dtype)
    patcher = FakePatcher(model)
    assert fused_norms.patch_fused_norms(patcher, "Flux #test") == 2
    assert set(patcher.object_patches) == {"diffusion_model.double_blocks.0.img_attn.norm.forward",
                                           "diffusion_model.single_blocks.0.norm.forward"}
    patch = patcher.object_patches["diffusion_model.single_blocks.0.norm.forward"]
    q, k, v = qkv(dtype=dtype)
    ref = patch.module.forward(q, k, v)
    first, second = patch(q, k, v), patch(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(first, ref))
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for a, b in zip(second, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < tol
    assert _norms()["paths"] == {fused_block_patch.PATH_QK: 2} and _norms()["handed_back"] == 0, _norms()


def test_qk_norm_guard_and_hand_backs(qk_norms_on):
    patcher = FakePatcher(FluxLike("torch"))
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    patch = patcher.object_patches["diffusion_model.double_blocks.0.img_attn.norm.forward"]
    q, k, v = qkv()
    with pytest.raises(TypeError):  # ComfyUI's forward gets the odd call, and rejects it too
        patch(q, k)
    original = patch.previous
    patch.previous = lambda *a: tuple(t * 1.05 for t in original(*a))
    patch(q, k, v)
    assert "rel. L2" in patch.fallbacks["cpu"]
    patch(q, k, v)
    reasons = _norms()["reasons"]
    assert reasons == {"arguments other than QKNorm's (q, k, v)": 1, fused_block_patch.REASON_FALLBACK: 2}, reasons


def test_other_qk_norms_are_left_alone():
    other = QKNorm(HEAD_DIM)
    other.query_norm = torch.nn.LayerNorm(HEAD_DIM)
    assert "query_norm" in fused_flux.fusable_qk_norm(other)

    class KreaQKNorm(QKNorm):  # another model's QKNorm class with its own forward
        def forward(self, q, k, v):
            return q, k

    assert "not ComfyUI's flux QKNorm" in fused_flux.fusable_qk_norm(KreaQKNorm(HEAD_DIM))


# ---- Flux's blocks ------------------------------------------------------------------------------
# ComfyUI 0.29's SingleStreamBlock / DoubleStreamBlock (comfy/ldm/flux/layers.py) restated: the
# modulation, the LayerNorms without affine, `apply_mod`'s addcmul / product, the in-place
# `x += ...` residuals. `attention` stands in for comfy.ldm.flux.math.attention (no RoPE here).

FLUX_HIDDEN = HEADS * HEAD_DIM


def attention(q, k, v, pe, mask=None, transformer_options={}):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def apply_mod(tensor, m_mult, m_add=None, modulation_dims=None):
    if modulation_dims is None:
        return torch.addcmul(m_add, tensor, m_mult) if m_add is not None else tensor * m_mult
    for d in modulation_dims:
        tensor[:, d[0]:d[1]] *= m_mult[:, d[2]:d[2] + 1]
        if m_add is not None:
            tensor[:, d[0]:d[1]] += m_add[:, d[2]:d[2] + 1]
    return tensor


class ModulationOut(types.SimpleNamespace):
    pass


class Modulation(torch.nn.Module):
    def __init__(self, dim, double):
        super().__init__()
        self.is_double, self.multiplier = double, 6 if double else 3
        self.lin = torch.nn.Linear(dim, self.multiplier * dim)

    def forward(self, vec):
        out = self.lin(torch.nn.functional.silu(vec[:, None, :])).chunk(self.multiplier, dim=-1)
        return (ModulationOut(shift=out[0], scale=out[1], gate=out[2]),
                ModulationOut(shift=out[3], scale=out[4], gate=out[5]) if self.is_double else None)


class SelfAttention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv, self.norm, self.proj = torch.nn.Linear(dim, 3 * dim), QKNorm(HEAD_DIM), torch.nn.Linear(dim, dim)


def _layer_norm(dim):
    return torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)


class DoubleStreamBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.hidden_size, self.modulation = HEADS, FLUX_HIDDEN, True
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", Modulation(FLUX_HIDDEN, True))
            setattr(self, f"{s}_norm1", _layer_norm(FLUX_HIDDEN))
            setattr(self, f"{s}_attn", SelfAttention(FLUX_HIDDEN))
            setattr(self, f"{s}_norm2", _layer_norm(FLUX_HIDDEN))
            setattr(self, f"{s}_mlp", torch.nn.Sequential(torch.nn.Linear(FLUX_HIDDEN, 2 * FLUX_HIDDEN),
                                                          torch.nn.GELU(approximate="tanh"),
                                                          torch.nn.Linear(2 * FLUX_HIDDEN, FLUX_HIDDEN)))

    def forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                transformer_options={}):
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        img_qkv = self.img_attn.qkv(apply_mod(self.img_norm1(img), (1 + img_mod1.scale), img_mod1.shift))
        img_q, img_k, img_v = img_qkv.view(img_qkv.shape[0], img_qkv.shape[1], 3, self.num_heads, -1).permute(
            2, 0, 3, 1, 4)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)
        txt_qkv = self.txt_attn.qkv(apply_mod(self.txt_norm1(txt), (1 + txt_mod1.scale), txt_mod1.shift))
        txt_q, txt_k, txt_v = txt_qkv.view(txt_qkv.shape[0], txt_qkv.shape[1], 3, self.num_heads, -1).permute(
            2, 0, 3, 1, 4)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)
        attn = attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                         torch.cat((txt_v, img_v), dim=2), pe=pe, mask=attn_mask)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]
        img += apply_mod(self.img_attn.proj(img_attn), img_mod1.gate)
        img += apply_mod(self.img_mlp(apply_mod(self.img_norm2(img), (1 + img_mod2.scale), img_mod2.shift)),
                         img_mod2.gate)
        txt += apply_mod(self.txt_attn.proj(txt_attn), txt_mod1.gate)
        txt += apply_mod(self.txt_mlp(apply_mod(self.txt_norm2(txt), (1 + txt_mod2.scale), txt_mod2.shift)),
                         txt_mod2.gate)
        return img, txt


class SingleStreamBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_size, self.num_heads = FLUX_HIDDEN, HEADS
        self.mlp_hidden_dim = self.mlp_hidden_dim_first = 2 * FLUX_HIDDEN
        self.yak_mlp = False
        self.mlp_act = torch.nn.GELU(approximate="tanh")
        self.linear1 = torch.nn.Linear(FLUX_HIDDEN, 3 * FLUX_HIDDEN + self.mlp_hidden_dim)
        self.linear2 = torch.nn.Linear(FLUX_HIDDEN + self.mlp_hidden_dim, FLUX_HIDDEN)
        self.norm = QKNorm(HEAD_DIM)
        self.pre_norm = _layer_norm(FLUX_HIDDEN)
        self.modulation = Modulation(FLUX_HIDDEN, False)

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
        mod, _ = self.modulation(vec)
        qkv, mlp = torch.split(self.linear1(apply_mod(self.pre_norm(x), (1 + mod.scale), mod.shift, modulation_dims)),
                               [3 * self.hidden_size, self.mlp_hidden_dim_first], dim=-1)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
        x += apply_mod(output, mod.gate, None, modulation_dims)
        return x


for _cls in (DoubleStreamBlock, SingleStreamBlock):
    _cls.__module__ = fused_block_patch.FLUX_MODULE


class FluxModel(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(3)
        self.double_blocks = torch.nn.ModuleList([DoubleStreamBlock()])
        self.single_blocks = torch.nn.ModuleList([SingleStreamBlock(), SingleStreamBlock()])
        self.to(dtype)


def flux_call(dtype=torch.float32, batch=1, img_tokens=7, txt_tokens=3):
    g = torch.Generator().manual_seed(4)
    img = (torch.randn(batch, img_tokens, FLUX_HIDDEN, generator=g) * 2).to(dtype)
    img[..., 5] *= 20  # an outlier channel, as DiT activations have
    txt = (torch.randn(batch, txt_tokens, FLUX_HIDDEN, generator=g) * 2).to(dtype)
    return dict(img=img, txt=txt, vec=torch.randn(batch, FLUX_HIDDEN, generator=g).to(dtype), pe=None)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flux_blocks_are_patched_served_and_match(dtype, qk_norms_on):
    """Both block kinds patched (and the four QKNorms inside them, which this fake patcher does
    not install: ComfyUI's does, tests/integration); each call matches ComfyUI's forward (bf16: to a rounding: the kernels round where ComfyUI rounds); the checked first call
    returns ComfyUI's output although that forward adds into its inputs; ours never writes into
    the caller's tensors."""
    model = FluxModel(dtype)
    patcher = FakePatcher(model)
    assert fused_norms.patch_fused_norms(patcher, "Flux #test") == 3 + 4
    double = patcher.object_patches["diffusion_model.double_blocks.0.forward"]
    single = patcher.object_patches["diffusion_model.single_blocks.1.forward"]
    assert isinstance(double, fused_flux.FusedFluxDoubleBlock) and isinstance(single, fused_flux.FusedFluxSingleBlock)
    call = flux_call(dtype)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    for _ in range(2):  # the checked call, then a served one
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        ref_in = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        ref = model.double_blocks[0].forward(**ref_in)
        out = double(**inputs)
        assert all(_rel(a, b) <= tol for a, b in zip(out, ref)), [_rel(a, b) for a, b in zip(out, ref)]
        x = torch.cat((call["txt"], call["img"]), 1)
        ref1 = model.single_blocks[1].forward(x.clone(), vec=call["vec"], pe=None)
        out1 = single(x, vec=call["vec"], pe=None)
        assert _rel(out1, ref1) <= tol
    assert torch.equal(x, torch.cat((call["txt"], call["img"]), 1)), "the served call wrote into its input"
    assert torch.equal(inputs["img"], call["img"]) and torch.equal(inputs["txt"], call["txt"])
    norms = _norms()
    assert norms["paths"] == {fused_block_patch.PATH_FLUX: 4} and norms["handed_back"] == 0, norms
    assert double.guarded == {"cpu"} and single.guarded == {"cpu"}


def test_flux_blocks_only_in_mode_all(monkeypatch):
    monkeypatch.setenv("TRITON_ACCEL_FUSED_NORMS", "qk")
    patcher = FakePatcher(FluxModel())
    assert fused_norms.patch_fused_norms(patcher, "Flux #test") == 4  # the QKNorms only
    assert not any(isinstance(p, fused_flux.FusedFluxBlock) for p in patcher.object_patches.values())


def test_flux_calls_it_cannot_serve_go_to_comfyui(qk_norms_on):
    model = FluxModel()
    patcher = FakePatcher(model)
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    single = patcher.object_patches["diffusion_model.single_blocks.0.forward"]
    double = patcher.object_patches["diffusion_model.double_blocks.0.forward"]
    call = flux_call()
    x = torch.cat((call["txt"], call["img"]), 1)
    patches = {"patches": {"attn1_output_patch": [lambda attn, extra: attn]}}
    single(x.clone(), vec=call["vec"], pe=None, transformer_options=patches)
    double(**call, transformer_options={"patches": {"attn1_patch": []}})
    single(x.clone(), vec=call["vec"], pe=None, modulation_dims=[(0, 2, 0)])
    with pytest.raises(TypeError):  # ComfyUI's forward gets the odd call, and rejects it too
        single(x.clone())
    reasons = _norms()["reasons"]
    assert reasons == {fused_block_patch.REASON_PATCHES: 2, "per-token modulation (modulation_dims) stays ComfyUI's": 1,
                       "arguments: x, vec, pe are required": 1}, reasons
    assert _norms()["served"] == 0


def test_flux_linears_read_the_norm_kernels_fp8_rows(monkeypatch, qk_norms_on):
    """The Linear after each fused norm runs inside quantize_once(h, rows): the single block's
    linear1, the double block's qkv and first MLP Linear per stream, with the rows the norm
    kernel wrote, and the single block's linear2 with the rows of its concatenated input; bit
    for bit the FP8 Linear's own quantisation of h."""
    from triton_accel.kernels.linear import fp8 as linear_fp8

    scopes, inside = _recording_scopes(monkeypatch, used=1)
    model = FluxModel()
    patcher = FakePatcher(model)
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    block, single = model.double_blocks[0], model.single_blocks[0]
    modules = {"img_qkv": block.img_attn.qkv, "txt_qkv": block.txt_attn.qkv, "img_mlp0": block.img_mlp[0],
               "txt_mlp0": block.txt_mlp[0], "img_proj": block.img_attn.proj, "linear1": single.linear1,
               "linear2": single.linear2}
    seen = {}
    for name, module in modules.items():
        module.register_forward_hook(
            (lambda name: lambda m, args, out: seen.setdefault(name, []).append((args[0], bool(inside))))(name))
    call = flux_call()
    for _ in range(2):
        seen.clear()
        scopes.clear()
        img, txt = patcher.object_patches["diffusion_model.double_blocks.0.forward"](**call)
        patcher.object_patches["diffusion_model.single_blocks.0.forward"](torch.cat((txt, img), 1), vec=call["vec"],
                                                                          pe=None)
    assert len(scopes) == 6
    for (x, rows), name in zip(scopes, ("img_qkv", "txt_qkv", "img_mlp0", "txt_mlp0", "linear1", "linear2")):
        (read, scoped), = seen[name]
        assert scoped and read is x, name
        q, scales = linear_fp8.quantize_activation(x.reshape(-1, x.shape[-1]))
        assert torch.equal(rows[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows[1], scales), name
    # linear2's input: the concatenation of the attention output and the MLP's activation, with
    # its rows from the same pass (kernels/linear/cat_fp8_rows.py)
    assert scopes[5][0].shape[-1] == FLUX_HIDDEN + single.mlp_hidden_dim
    assert not seen["img_proj"][0][1]


def test_flux_block_guard_sends_a_disagreeing_block_back(qk_norms_on):
    patcher = FakePatcher(FluxModel())
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    single = patcher.object_patches["diffusion_model.single_blocks.0.forward"]
    original = single.previous
    single.previous = lambda *a, **k: original(*a, **k) * 1.05
    call = flux_call()
    x = torch.cat((call["txt"], call["img"]), 1)
    single(x.clone(), vec=call["vec"], pe=None)
    assert "rel. L2" in single.fallbacks["cpu"]
    # one check covers every single block of the model (one Guard per block kind)
    other = patcher.object_patches["diffusion_model.single_blocks.1.forward"]
    assert other.fallbacks is single.fallbacks
    other(x.clone(), vec=call["vec"], pe=None)
    assert _norms()["reasons"][fused_block_patch.REASON_FALLBACK] == 2


def test_other_flux_blocks_are_left_alone():
    class KontextDouble(DoubleStreamBlock):  # a subclass with its own forward: never patched
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    block = DoubleStreamBlock()
    block.flipped_img_txt = True
    assert "flipped" in fused_flux.fusable_flux_block(block)
    affine = SingleStreamBlock()
    affine.pre_norm = torch.nn.LayerNorm(FLUX_HIDDEN)
    assert "pre_norm" in fused_flux.fusable_flux_block(affine)
    assert "not ComfyUI's flux" in fused_flux.fusable_flux_block(KontextDouble())
    assert fused_flux.fusable_flux_block(SingleStreamBlock()) is None and fused_flux.fusable_flux_block(DoubleStreamBlock()) is None


def test_no_rows_for_a_linear_that_hands_the_stream_back():
    """A Linear carrying our Linear patch (ComfyUI installs it as the module's own forward) with
    min_tokens above the stream's token count never reads rows: none are made for it (Flux's
    512-token text stream under min_tokens 1024); any other module may read them."""

    linear = torch.nn.Linear(8, 8)
    x = torch.randn(1, 7, 8)
    assert fused_block_patch.may_read_rows(linear, x)
    layer = linear_layer.LinearLayer.__new__(linear_layer.LinearLayer)
    layer.state = types.SimpleNamespace(min_tokens=8)
    linear.forward = layer
    assert not fused_block_patch.may_read_rows(linear, x)
    layer.state.min_tokens = 7
    assert fused_block_patch.may_read_rows(linear, x)
    patch = fused_flux.FusedFluxSingleBlock("Flux #test", "single_blocks.0", SingleStreamBlock(), None)
    layer.state.min_tokens = 8
    assert not patch._wants_rows("linear1", True, linear, x) and patch._wants_rows("linear1", True)


# ---- Flux's QK norm + RoPE into the attention's q and k (TRITON_ACCEL_FUSED_ROPE) -------------
# comfy.ldm.flux.math restated as functions whose globals are a namespace named like it:
# `attention` applies RoPE (0.29's _apply_rope1 formula) and calls `optimized_attention`, which
# records the q / k it was handed.

def _math_optimized_attention(q, k, v, heads, skip_reshape=False, mask=None, transformer_options={}):
    calls.append(dict(q_stride=q.stride(), k_stride=k.stride(), shape=tuple(q.shape)))  # noqa: F821
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _math_apply_rope1(x, freqs_cis):
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0]
    x_out.addcmul_(freqs_cis[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def _math_attention(q, k, v, pe, mask=None, transformer_options={}):
    if pe is not None:
        q, k = apply_rope1(q, pe), apply_rope1(k, pe)  # noqa: F821
    return optimized_attention(q, k, v, q.shape[1], skip_reshape=True, mask=mask,  # noqa: F821
                               transformer_options=transformer_options)


@pytest.fixture
def flux_math(monkeypatch):
    """The fake blocks' `attention` global (what _flux_attention reads) becomes ComfyUI's."""
    import sys

    namespace = {"__name__": fused_block_patch.FLUX_MATH_MODULE, "torch": torch, "calls": []}
    for name, fn in (("optimized_attention", _math_optimized_attention), ("apply_rope1", _math_apply_rope1),
                     ("attention", _math_attention)):
        namespace[name] = types.FunctionType(fn.__code__, namespace, name, fn.__defaults__)
    monkeypatch.setattr(sys.modules[__name__], "attention", namespace["attention"])
    return types.SimpleNamespace(**namespace)


def flux_pe(batch, tokens):
    """comfy.ldm.flux.math.rope's output as EmbedND hands it over: [B, 1, L, D/2, 2, 2] float32."""
    angles = torch.rand(batch, tokens, HEAD_DIM // 2, generator=torch.Generator().manual_seed(9)) * 6
    return torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).reshape(
        batch, 1, tokens, HEAD_DIM // 2, 2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flux_blocks_norm_and_rope_into_the_attentions_q_and_k(dtype, qk_norms_on, flux_math):
    """With ComfyUI's attention function and rope, both blocks hand optimized_attention a q and k
    of [B, L, H, D] memory (the double block's text and image rows in one tensor) that the QK
    norm + RoPE kernel wrote, and their outputs match ComfyUI's forward (norm, cat, RoPE)."""
    model = FluxModel(dtype)
    patcher = FakePatcher(model)
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    double = patcher.object_patches["diffusion_model.double_blocks.0.forward"]
    single = patcher.object_patches["diffusion_model.single_blocks.0.forward"]
    call = dict(flux_call(dtype), pe=flux_pe(1, 10))
    tol = 1e-6 if dtype == torch.float32 else 0.0
    for _ in range(2):  # the checked call, then a served one
        ref = model.double_blocks[0].forward(**{k: v.clone() for k, v in call.items()})
        flux_math.calls.clear()
        out = double(**{k: v.clone() for k, v in call.items()})
        assert all(_rel(a, b) <= tol for a, b in zip(out, ref)), [_rel(a, b) for a, b in zip(out, ref)]
        x = torch.cat((call["txt"], call["img"]), 1)
        ref1 = model.single_blocks[0].forward(x.clone(), vec=call["vec"], pe=call["pe"])
        out1 = single(x.clone(), vec=call["vec"], pe=call["pe"])
        assert _rel(out1, ref1) <= tol
    # The served calls' q and k: [B, H, L, D] views of [B, L, H, D] memory, 3 + 7 rows in one.
    blhd = (10 * HEADS * HEAD_DIM, HEAD_DIM, HEADS * HEAD_DIM, 1)
    assert flux_math.calls[0] == dict(q_stride=blhd, k_stride=blhd, shape=(1, HEADS, 10, HEAD_DIM)), flux_math.calls
    # calls[1]: ComfyUI's own single block (the reference), q contiguous [B, H, L, D]
    assert flux_math.calls[1]["q_stride"] != blhd and flux_math.calls[2]["q_stride"] == blhd, flux_math.calls
    assert _norms()["handed_back"] == 0


def test_flux_rope_fusion_stays_off_where_it_must(monkeypatch, qk_norms_on, flux_math):
    """Off by TRITON_ACCEL_FUSED_ROPE, without pe, with another attention function, or with
    another node's patch on a QKNorm: the block then runs the norm, cat and ComfyUI's RoPE."""
    model = FluxModel()
    patcher = FakePatcher(model)
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    block = model.double_blocks[0]
    norms = (block.img_attn.norm, block.txt_attn.norm)
    pe = flux_pe(1, 10)
    assert fused_flux._rope_refusal(block, norms, pe) is None
    assert fused_flux._rope_refusal(block, norms, None) == "no rope"
    assert patcher.object_patches["diffusion_model.double_blocks.0.forward"].fuse_rope
    monkeypatch.setenv("TRITON_ACCEL_FUSED_ROPE", "0")  # read when the node patches
    off = FakePatcher(FluxModel())
    fused_norms.patch_fused_norms(off, "Flux #test")
    patch = off.object_patches["diffusion_model.double_blocks.0.forward"]
    assert not patch.fuse_rope and "TRITON_ACCEL_FUSED_ROPE" in fused_flux._rope_refusal(block, norms, pe, patch.fuse_rope)
    monkeypatch.delenv("TRITON_ACCEL_FUSED_ROPE")
    block.img_attn.norm.forward = lambda q, k, v: (q, k)  # another node's object patch
    assert "another node" in fused_flux._rope_refusal(block, norms, pe)
    del block.img_attn.norm.forward
    guarded = fused_flux.FusedQKNorm("Flux #test", "x", block.img_attn.norm, block.img_attn.norm.forward)
    block.img_attn.norm.forward = guarded  # ours: still fused
    assert fused_flux._rope_refusal(block, norms, pe) is None
    del block.img_attn.norm.forward
    import sys
    monkeypatch.setattr(sys.modules[__name__], "attention", lambda q, k, v, pe, mask=None, transformer_options={}: q)
    assert "not ComfyUI's flux attention" in fused_flux._rope_refusal(block, norms, pe)


def test_flux_rope_call_the_kernel_refuses_runs_comfyuis_way(monkeypatch, qk_norms_on, flux_math):
    """A head dim the QK norm + RoPE kernel does not take (48 here): that call runs the norm,
    then ComfyUI's attention with its RoPE, and still matches ComfyUI's forward."""
    from triton_accel.kernels.fused import qk_norm_rope as qnr

    monkeypatch.setattr(qnr, "HEAD_DIMS", (64,))
    model = FluxModel()
    patcher = FakePatcher(model)
    fused_norms.patch_fused_norms(patcher, "Flux #test")
    single = patcher.object_patches["diffusion_model.single_blocks.0.forward"]
    call = flux_call()
    x = torch.cat((call["txt"], call["img"]), 1)
    pe = flux_pe(1, 10)
    for _ in range(2):
        ref = model.single_blocks[0].forward(x.clone(), vec=call["vec"], pe=pe)
        out = single(x.clone(), vec=call["vec"], pe=pe)
        assert _rel(out, ref) <= 1e-6
    assert all(c["q_stride"][-2] == HEAD_DIM for c in flux_math.calls)  # [B, H, L, D]: not the fused layout
    assert _norms()["handed_back"] == 0
