"""Fused activations: the object patches of the GELU modules (and their nn.Sequential under
torch.compile) whose Linear our kernel serves with the GELU in its epilogue, and where they go."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .activation_marks import ACTIVATION_GELU_TANH, activated_copy, is_activated, release_mark
from .linear_common import is_compiling, is_linear_module, submodule

if TYPE_CHECKING:
    from .linear_layer import LinearLayer
    from .linear_state import LinearPatchState


class ModulePatch:
    """An object patch of one module's forward: `previous` is the forward it replaces (the
    module's own, or another node's patch). Shared by clones, never copied."""

    def __init__(self, name: str, module: torch.nn.Module, previous):
        self.name = name
        self.module = module
        self.previous = previous

    def __deepcopy__(self, memo):
        return self


class FusedActivation(ModulePatch):
    """The object patch of an activation module whose Linear our kernel serves with the
    activation fused: a tensor our kernel activated passes through, anything else (every call
    ComfyUI's Linear or an extension served, and everything under torch.compile's tracing) goes
    to the module's own forward."""

    def __call__(self, *args, **kwargs):
        if (len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor and not is_compiling()
                and is_activated(args[0])):
            copy = activated_copy(args[0])
            release_mark(args[0])
            return args[0] if copy is None else copy
        return self.previous(*args, **kwargs)


class FusedSequential(ModulePatch):
    """The object patch of an nn.Sequential whose Linear (child `index`) our kernel serves with
    the GELU after it (child `index + 1`) fused. Eager calls run the Sequential's own forward
    (the children's patches fuse through FusedActivation's marks). Under torch.compile's tracing,
    where a traced graph keeps no marks, the pair is recorded as one activated patched_linear
    op (the GELU in our epilogue at run time, as eager) and the other children as they are;
    anything the op could not serve traces the Sequential's own forward."""

    def __init__(self, name: str, module: torch.nn.Module, previous, layer: LinearLayer, index: int):
        super().__init__(name, module, previous)
        self.layer = layer
        self.index = index

    def __call__(self, *args, **kwargs):
        if not is_compiling() or len(args) != 1 or kwargs or not self.layer.traces_fused(args[0]):
            return self.previous(*args, **kwargs)
        children = list(self.module)
        # Another node's patch installed over ours on either child: trace everything as it is.
        if (len(children) <= self.index + 1 or children[self.index].forward is not self.layer
                or not isinstance(children[self.index + 1].forward, FusedActivation)):
            return self.previous(*args, **kwargs)
        x = args[0]
        for i, child in enumerate(children):
            if i == self.index:
                x = torch.ops.triton_accel.patched_linear(x, self.layer.token, True)
            elif i != self.index + 1:
                x = child(x)
        return x


def _is_gelu_tanh(module) -> bool:
    return type(module) is torch.nn.GELU and module.approximate == "tanh"


def fusable_activations(diffusion_model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(Linear name, activation module name, first activated column) for each GELU-tanh fed by
    a Linear alone: nn.Sequential(..., Linear, GELU(tanh), ...) (Flux double blocks, Wan FFN,
    Chroma, HunyuanVideo). Flux's single blocks: fusable_with_copy."""
    found = []
    for name, module in diffusion_model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, torch.nn.Sequential):
            children = list(module.named_children())
            for (n1, m1), (n2, m2) in zip(children, children[1:]):
                if is_linear_module(m1) and _is_gelu_tanh(m2):
                    found.append((prefix + n1, prefix + n2, 0))
    return found


def fusable_with_copy(diffusion_model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(Linear name, activation module name, first activated column) for Flux-style single
    blocks: `qkv, mlp = split(linear1(x), [3 * hidden_size, mlp_hidden_dim])`, then
    `mlp_act(mlp)` (GELU tanh) goes into `torch.cat((attn, ...))`.

    The GELU is fused there only with a contiguous copy of the activated columns
    (kernels.linear.dispatch's activation_out): handed the strided slice of linear1's output instead of
    GELU's contiguous result, that cat runs its non-vectorised kernel, which cost more than the
    GELU pass saved (H200, Flux 12B, one step: 5.9 ms saved, 7.6 ms more in the cat;
    benchmarks/RESULTS.md). Blocks whose MLP takes another slice (a gated
    `yak_mlp`, SiLU variants) are left alone."""
    found = []
    for name, module in diffusion_model.named_modules():
        if type(module).__name__ != "SingleStreamBlock":
            continue
        linear1, act = getattr(module, "linear1", None), getattr(module, "mlp_act", None)
        hidden, mlp = getattr(module, "hidden_size", None), getattr(module, "mlp_hidden_dim", None)
        if (not is_linear_module(linear1) or not _is_gelu_tanh(act) or not isinstance(hidden, int)
                or not isinstance(mlp, int) or getattr(module, "yak_mlp", False)
                or getattr(module, "mlp_hidden_dim_first", mlp) != mlp
                or linear1.out_features != 3 * hidden + mlp):
            continue
        prefix = f"{name}." if name else ""
        found.append((prefix + "linear1", prefix + "mlp_act", 3 * hidden))
    return found


def install_fused_activations(patched, state: LinearPatchState, with_copies: bool = False) -> None:
    """Give each fusable layer its activation and patch the activation module (`with_copies`:
    the fusable_with_copy() ones too)."""
    layers = {layer.name: layer for layer in state.layers}
    diffusion_model = patched.model.diffusion_model
    fusable = [(*f, False) for f in fusable_activations(diffusion_model)]
    if with_copies:
        fusable += [(*f, True) for f in fusable_with_copy(diffusion_model)]
    for linear_name, act_name, first, with_copy in fusable:
        layer = layers.get(linear_name)
        if layer is None or layer.skip_reason:
            continue
        key = f"diffusion_model.{act_name}.forward"
        previous = patched.get_model_object(key)
        while isinstance(previous, FusedActivation):  # re-patching one of our clones
            previous = previous.previous
        module = submodule(diffusion_model, act_name)
        layer.activation = (ACTIVATION_GELU_TANH, first)
        layer.activation_copy = with_copy
        layer.activation_forward = previous
        fused = FusedActivation(act_name, module, previous)
        layer.activation_patch = fused
        layer.companions.append((module, fused))
        patched.add_object_patch(key, fused)
        if not with_copy:  # Sequential(..., Linear, GELU, ...): one op for the pair under torch.compile
            _fuse_sequential(patched, diffusion_model, layer, linear_name)


def _fuse_sequential(patched, diffusion_model, layer: LinearLayer, linear_name: str) -> None:
    seq_name, _, child = linear_name.rpartition(".")
    seq = submodule(diffusion_model, seq_name) if seq_name else None
    if not isinstance(seq, torch.nn.Sequential) or not child.isdigit():
        return
    key = f"diffusion_model.{seq_name}.forward"
    previous = patched.get_model_object(key)
    while isinstance(previous, FusedSequential):  # re-patching one of our clones
        previous = previous.previous
    fused = FusedSequential(seq_name, seq, previous, layer, int(child))
    layer.companions.append((seq, fused))
    patched.add_object_patch(key, fused)
