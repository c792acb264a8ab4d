"""The benchmark's engine, shared by the TritonAccelBenchmark node and benchmarks/model_benchmark.py.

Plain torch (+ Triton's do_bench, + matplotlib or Pillow for the chart when importable); never
imports ComfyUI, so the command line runs it on a GPU machine without ComfyUI. The node feeds
it the shapes a real forward sent and ComfyUI's own attention as the baseline; the command
line feeds it a model family's known shapes and PyTorch SDPA.

Numbers: every implementation is timed on random inputs of the recorded shape (randn, never
zeros: zeros make every kernel look accurate and some look fast), and its output is compared
with a float32 reference computed on a sample of query rows (attention) or token rows (Linear),
so a Wan-sized call never materialises its 32760 x 32760 scores.
"""
from __future__ import annotations

import datetime
import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from .. import kernels
from ..kernels.core import extensions
from ..kernels.core.gpu_rules import BACKEND_OF_PATH, LINEAR_LABEL, PATH_LABEL
from .guards import LOSSLESS_BAR, agreement, agreement_bar, agrees
from .linear_common import EXT_GUARD_MAX_REL_L2, GUARD_MAX_REL_L2, MIN_TOKENS, SKIP_AUTO, SkipPatterns

log = logging.getLogger("triton_accel.benchmark")  # not __name__: the clone's folder name

RESULT_VERSION = 1
REFERENCE_ROWS = 256  # query / token rows compared with the float32 reference
# Beyond these a path is reported but not counted as a speed-up: the same bars the auto
# choice (speed_choice.agreement_bar: per attention path, rel. L2 and for quantized paths the
# worst head's cosine) and the Linear quality guard (linear_common.GUARD_MAX_REL_L2, per method)
# use. The reference here is float32 attention; auto compares with ComfyUI's own output, which
# is within bf16 rounding of it, so a path that passes here passes there.
ATTENTION_MAX_REL_L2 = LOSSLESS_BAR.max_rel_l2  # PyTorch's own row: rounding only
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PYTORCH_IMPL = "pytorch"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- shapes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    """One attention call as [B, H, L, D] tensors (ComfyUI's [B, L, H*D] calls normalised)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: str
    mask: str = "none"  # "none" | "bool" | "additive"
    mask_shape: Optional[tuple] = None  # 4-D, broadcastable to [B, H, Lq, Lk]

    @property
    def label(self) -> str:
        heads = f"{self.heads}" if self.kv_heads == self.heads else f"{self.heads}/{self.kv_heads}"
        mask = "" if self.mask == "none" else f" {self.mask} mask"
        return f"B{self.batch} H{heads} {self.q_len}x{self.kv_len} d{self.head_dim} {self.dtype}{mask}"

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.heads * self.q_len * self.kv_len * (self.head_dim + self.v_head_dim)

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionShape":
        d = dict(d)
        if d.get("mask_shape") is not None:
            d["mask_shape"] = tuple(int(x) for x in d["mask_shape"])
        d.setdefault("kv_heads", d["heads"])
        d.setdefault("v_head_dim", d["head_dim"])
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class LinearShape:
    """One Linear call: x [rows, in_features] @ W.T [in_features, out_features]."""

    rows: int
    in_features: int
    out_features: int
    dtype: str
    bias: bool = True
    weight_dtype: str = ""  # the layer's stored weight dtype ("float8_e4m3fn" for FP8 checkpoints)
    kept_by: str = ""  # why the Linear patch would leave this call to ComfyUI ("" = it would serve it)

    @property
    def label(self) -> str:
        return f"{self.rows}x{self.in_features}->{self.out_features} {self.dtype}"

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.in_features * self.out_features

    @classmethod
    def from_dict(cls, d: dict) -> "LinearShape":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def attention_shape_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> AttentionShape:
    """The shape record of a call already in [B, H, L, D] layout (mask 4-D or None)."""
    kind = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "additive")
    return AttentionShape(batch=q.shape[0], heads=q.shape[1], kv_heads=k.shape[1], q_len=q.shape[2],
                          kv_len=k.shape[2], head_dim=q.shape[3], v_head_dim=v.shape[3], dtype=dtype_name(q.dtype),
                          mask=kind, mask_shape=None if mask is None else tuple(mask.shape))


def linear_kept_by(name: str, rows: int) -> str:
    """Why TritonAccelPatchLinear (default skip patterns) would leave this call to ComfyUI, or ""."""
    pattern = SkipPatterns.parse(SKIP_AUTO).match(name) if name else None
    if pattern:
        return f"default skip pattern {pattern!r}"
    if rows < MIN_TOKENS:
        return f"{rows} rows: the patch keeps ComfyUI's Linear below {MIN_TOKENS}"
    return ""


class ShapeRecorder:
    """Counts the attention and Linear calls of a forward, deduplicated by shape."""

    def __init__(self):
        self.attention: Counter = Counter()
        self.linear: Counter = Counter()
        self.skipped: Counter = Counter()  # attention calls that could not be normalised, by reason

    def add_attention(self, shape: AttentionShape) -> None:
        self.attention[shape] += 1

    def add_linear(self, x: torch.Tensor, module: torch.nn.Module, name: str = "") -> None:
        weight = module.weight
        rows = x.numel() // max(1, x.shape[-1])
        self.linear[LinearShape(rows=rows, in_features=x.shape[-1], out_features=int(weight.shape[0]),
                                dtype=dtype_name(x.dtype), bias=getattr(module, "bias", None) is not None,
                                weight_dtype=dtype_name(weight.dtype), kept_by=linear_kept_by(name, rows))] += 1

    def shapes(self) -> dict:
        """JSON-ready: what --shapes-json of the command line reads back."""
        return {"attention": [dict(asdict(s), count=n) for s, n in self.attention.most_common()],
                "linear": [dict(asdict(s), count=n) for s, n in self.linear.most_common()],
                "skipped_attention": dict(self.skipped)}


def shapes_from_json(data: dict) -> tuple[list, list]:
    """[(AttentionShape, count)], [(LinearShape, count)] from shapes() output or a saved result."""
    src = data.get("shapes", data)

    def read(cls, items):  # a shapes() entry, or a result row {"shape": {...}, "count": n}
        return [(cls.from_dict(d.get("shape", d)), int(d.get("count", 1))) for d in items]
    return read(AttentionShape, src.get("attention", [])), read(LinearShape, src.get("linear", []))


# ---- timing ------------------------------------------------------------------------------------

class Timer:
    """Median milliseconds of a zero-argument function on `device`.

    CUDA: triton.testing.do_bench (it flushes L2 between runs and times with CUDA events), its
    budget sized for about `repeats` runs. Elsewhere: the median of `repeats` wall-clock runs
    after one warm-up run.
    """

    def __init__(self, device: torch.device, repeats: int = 20):
        self.device = torch.device(device)
        self.repeats = max(1, int(repeats))
        self.name = (f"triton.testing.do_bench, median (~{self.repeats} runs)" if self.device.type == "cuda"
                     else f"median of {self.repeats} wall-clock runs")

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            return self._cuda(fn)
        fn()
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _cuda(self, fn) -> float:
        import triton.testing

        fn()
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        estimate = max(start.elapsed_time(end) / 3, 1e-3)
        warmup, rep = max(1.0, 3 * estimate), max(1.0, self.repeats * estimate)
        try:
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        except TypeError:  # Triton releases before return_mode=
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])[0])


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().flatten(), ref.float().flatten()
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _sample_rows(n: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, min(n, REFERENCE_ROWS)).round().long().unique()


# ---- attention ---------------------------------------------------------------------------------

def make_attention_inputs(shape: AttentionShape, device, seed: int = 0):
    """Random q, k, v (and mask) of the recorded shape. Masks hide the last eighth of the keys
    (padding, as text encoders' masks do) and never a whole row."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPES[shape.dtype]

    def rand(*size):
        return torch.randn(*size, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    q = rand(shape.batch, shape.heads, shape.q_len, shape.head_dim)
    k = rand(shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim)
    v = rand(shape.batch, shape.kv_heads, shape.kv_len, shape.v_head_dim)
    mask = None
    if shape.mask != "none":
        mshape = shape.mask_shape or (1, 1, 1, shape.kv_len)
        hidden = torch.zeros(mshape[-1], dtype=torch.bool)
        if mshape[-1] == shape.kv_len and shape.kv_len > 1:
            hidden[shape.kv_len - max(1, shape.kv_len // 8):] = True
        if shape.mask == "bool":
            mask = (~hidden).expand(mshape).contiguous().to(device)
        else:
            add = (torch.randn(mshape, generator=g) * 0.5).masked_fill(hidden, float("-inf"))
            mask = add.to(device=device, dtype=dtype)
    return q, k, v, mask


def attention_reference_rows(q, k, v, mask, rows: torch.Tensor) -> torch.Tensor:
    """float32 attention for the query rows `rows` (all keys), a few heads at a time."""
    b, h, lq, d = q.shape
    rep = h // k.shape[1]
    rows = rows.to(q.device)
    qs = q[:, :, rows].float() / math.sqrt(d)
    m = None
    if mask is not None:
        m = mask.expand(mask.shape[0], mask.shape[1], lq, k.shape[2])[:, :, rows]
        m = torch.zeros(m.shape, device=q.device).masked_fill(~m, float("-inf")) if m.dtype == torch.bool else m.float()
    outs = []
    for h0 in range(0, h, 4):
        kv_heads = torch.arange(h0, min(h, h0 + 4), device=q.device) // rep
        s = qs[:, h0:h0 + 4] @ k[:, kv_heads].float().transpose(-1, -2)
        if m is not None:
            s = s + (m if m.shape[1] == 1 else m[:, h0:h0 + 4])
        outs.append(torch.softmax(s, -1) @ v[:, kv_heads].float())
    return torch.cat(outs, 1)


def sdpa_attention(q, k, v, mask):
    """The command line's baseline: PyTorch SDPA (what ComfyUI's attention_pytorch runs)."""
    extra = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


def _per_head(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], -1)  # [B, H, rows, D] -> one slice per (batch, head)


def _judge_attention(entry: dict, path: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """rel. L2, worst-head cosine and whether `path` is within auto's bar for it."""
    bar = agreement_bar(path)
    metrics = agreement(out, ref, _per_head)
    if not bool(torch.isfinite(out).all()):
        metrics["rel_l2"] = float("nan")
    entry.update(rel_l2=metrics["rel_l2"], min_cosine=metrics["min_cosine"], within_bar=agrees(metrics, bar),
                 bar={"max_rel_l2": bar.max_rel_l2, "min_cosine": bar.min_cosine})


def within_bar(row: dict, r: dict) -> bool:
    """Whether an entry ran within its accuracy bar (False for NaN or no figure)."""
    if "within_bar" in r:
        return bool(r["within_bar"])
    return r["rel_l2"] is not None and r["rel_l2"] <= row["max_rel_l2"]


def _measure(impl: str, label: str, fn, timer, flops, ref, rows, cut, judge_path: Optional[str] = None) -> dict:
    """One implementation's entry: ms, TFLOP/s, rel. L2 against the reference (with judge_path:
    judged by that attention path's bar); errors kept as text."""
    entry = {"impl": impl, "label": label, "ms": None, "tflops": None, "rel_l2": None, "error": None}
    try:
        out = fn()
        if judge_path is not None:
            _judge_attention(entry, judge_path, cut(out, rows), ref)
        else:
            entry["rel_l2"] = rel_l2(cut(out, rows), ref)
        entry["ms"] = timer(fn)
        entry["tflops"] = flops / (entry["ms"] * 1e9) if entry["ms"] > 0 else None
    except Exception as e:  # one failing path must not lose the others' numbers
        log.warning("Triton Accel benchmark: %s failed: %s: %s", label, type(e).__name__, e)
        entry["error"] = f"{type(e).__name__}: {e}"[:300]
    return entry


def attention_backend(path: str) -> tuple[Optional[str], str]:
    """(kernels.attention backend, label) of an attention path: ours through BACKEND_OF_PATH,
    another pack's "ext:<name>" by its own name (the registry knows it so) and label."""
    if extensions.is_extension_path(path):
        extension = extensions.get(path, extensions.KIND_ATTENTION)
        return path, f"{path} ({extension.label})" if extension is not None else path
    return BACKEND_OF_PATH.get(path), PATH_LABEL.get(path, path)


def linear_label(method: str) -> str:
    if extensions.is_extension_path(method):
        extension = extensions.get(method, extensions.KIND_LINEAR)
        return f"{method} ({extension.label})" if extension is not None else method
    return LINEAR_LABEL.get(method, method)


def linear_bar(method: Optional[str]) -> float:
    """The Linear guard's rel. L2 bar for one of ours or an extension (linear_common)."""
    if extensions.is_extension_path(method):
        return EXT_GUARD_MAX_REL_L2[extensions.is_lossy(method)]
    return GUARD_MAX_REL_L2.get(method, min(GUARD_MAX_REL_L2.values()))


def bench_attention(shape: AttentionShape, count: int, device, timer: Timer, baseline, baseline_label: str,
                    paths: list) -> dict:
    """PyTorch (`baseline`) and each of our `paths` at one attention shape."""
    q, k, v, mask = make_attention_inputs(shape, device)
    rows = _sample_rows(shape.q_len)
    ref = attention_reference_rows(q, k, v, mask, rows)

    def cut(out, r):
        return out[:, :, r.to(out.device)]

    kb, vb = k, v
    if shape.kv_heads != shape.heads:  # ComfyUI's backends take equal heads; expanded outside the timing
        kb = k.repeat_interleave(shape.heads // shape.kv_heads, 1)
        vb = v.repeat_interleave(shape.heads // shape.kv_heads, 1)
    results = [_measure(PYTORCH_IMPL, baseline_label, lambda: baseline(q, kb, vb, mask), timer, shape.flops,
                        ref, rows, cut)]
    for path in paths:
        backend, label = attention_backend(path)
        ok, reason = kernels.attention_support(q, k, v, mask, backend=backend) if backend else (False, "no backend")
        if not ok:
            results.append({"impl": path, "label": label, "ms": None, "tflops": None, "rel_l2": None,
                            "error": f"refused: {reason}"})
            continue
        results.append(_measure(path, label, lambda b=backend: kernels.attention(q, k, v, attn_mask=mask, backend=b),
                                timer, shape.flops, ref, rows, cut, judge_path=path))
    return {"kind": "attention", "label": shape.label, "shape": asdict(shape), "count": count,
            "flops": shape.flops, "results": results, "max_rel_l2": ATTENTION_MAX_REL_L2}


# ---- Linear ------------------------------------------------------------------------------------

def make_linear_inputs(shape: LinearShape, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    x = torch.randn(shape.rows, shape.in_features, generator=g).to(device=device, dtype=dtype)
    # Weights scaled like a trained layer's (unit-variance outputs), so bf16 rounding is realistic.
    w = (torch.randn(shape.out_features, shape.in_features, generator=g) * shape.in_features ** -0.5)
    bias = (torch.randn(shape.out_features, generator=g) * 0.1).to(device=device, dtype=dtype) if shape.bias else None
    return x, w.to(device=device, dtype=dtype), bias


def bench_linear(shape: LinearShape, count: int, device, timer: Timer, method: Optional[str],
                 extra_methods: tuple = ()) -> dict:
    """torch's Linear and (when `method` is given and accepted) our quantised Linear at one shape;
    `method` may be another pack's "ext:<name>", and `extra_methods` more of them (auto's)."""
    x, w, bias = make_linear_inputs(shape, device)
    baseline_label, baseline = "PyTorch Linear", lambda: torch.nn.functional.linear(x, w, bias)
    if shape.weight_dtype == "float8_e4m3fn":
        # An FP8 checkpoint (weight_dtype fp8_e4m3fn): ComfyUI upcasts the weight on every call,
        # and our methods take the FP8 weight as it is.
        w = w.to(torch.float8_e4m3fn)
        baseline_label = "PyTorch Linear (FP8 weight upcast per call)"
        baseline = lambda: torch.nn.functional.linear(x, w.to(x.dtype), bias)  # noqa: E731
    rows = _sample_rows(shape.rows)
    ref = x[rows.to(x.device)].float() @ w.float().T
    if bias is not None:
        ref = ref + bias.float()

    def cut(out, r):
        return out[r.to(out.device)]

    results = [_measure(PYTORCH_IMPL, baseline_label, baseline, timer, shape.flops, ref, rows, cut)]
    row = {"kind": "linear", "label": shape.label, "shape": asdict(shape), "count": count, "flops": shape.flops,
           "results": results, "max_rel_l2": linear_bar(method)}
    for m in ([method] if method is not None else []) + [p for p in extra_methods if p != method]:
        results.append(_bench_linear_ext(m, shape, x, w, bias, timer, ref, rows, cut)
                       if extensions.is_extension_path(m) else _bench_linear_ours(m, shape, x, w, bias, timer, ref,
                                                                                  rows, cut, row))
    return row


def _bench_linear_ours(method, shape, x, w, bias, timer, ref, rows, cut, row) -> dict:
    label = LINEAR_LABEL.get(method, method)
    refusal = f"not patched: {shape.kept_by}" if shape.kept_by else None
    if refusal is None:
        reason = kernels.linear_refusal(method, x.device, x.dtype)
        refusal = f"refused: {reason}" if reason else None
    if refusal is None:
        try:
            t0 = time.perf_counter()
            prepared = kernels.prepare_weight(w, method)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            row["prepare_ms"] = (time.perf_counter() - t0) * 1e3
        except ValueError as e:  # LinearInputError: a shape the kernels do not take
            refusal = f"refused: {getattr(e, 'reason', e)}"
    if refusal is not None:
        return {"impl": method, "label": label, "ms": None, "tflops": None, "rel_l2": None, "error": refusal}
    return _measure(method, label, lambda: kernels.linear(x, prepared, bias), timer, shape.flops, ref, rows, cut)


def _bench_linear_ext(path, shape, x, w, bias, timer, ref, rows, cut) -> dict:
    """Another pack's Linear on the same inputs, through the guard the patch calls it with
    (weight in x's dtype: an FP8 checkpoint's upcast, as ComfyUI's cast gives it)."""
    label = linear_label(path)
    weight = w.to(x.dtype) if w.dtype != x.dtype else w
    refusal = extensions.linear_call_refusal(path, x, weight, bias)
    if refusal is not None:
        return {"impl": path, "label": label, "ms": None, "tflops": None, "rel_l2": None,
                "error": f"refused: {refusal}"}
    entry = _measure(path, label, lambda: extensions.run_linear(path, x, weight, bias), timer, shape.flops, ref,
                     rows, cut)
    entry["within_bar"] = entry["rel_l2"] is not None and entry["rel_l2"] <= linear_bar(path)
    return entry


# ---- the whole run -----------------------------------------------------------------------------

def best_ours(row: dict) -> Optional[dict]:
    """Our fastest entry of a row that ran and is within the accuracy bar, or None."""
    ok = [r for r in row["results"][1:] if r["ms"] is not None and within_bar(row, r)]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def summarize(result: dict) -> dict:
    """Time per forward spent in the recorded calls: sum of count x ms, PyTorch's against ours.

    Ours per shape is what the patch would run: our fastest accurate path (PyTorch where none
    is accurate, as the quality checks decide), and for attention in auto (which times both per
    shape, result["attention_keeps_faster"]) PyTorch wherever it is the faster one.
    """
    out = {}
    for kind in ("attention", "linear"):
        theirs = ours = 0.0
        keeps_faster = kind == "attention" and result.get("attention_keeps_faster", False)
        for row in result.get(kind, []):
            base = row["results"][0]["ms"]
            if base is None:
                continue
            best = best_ours(row)
            mine = best["ms"] if best else base
            theirs += row["count"] * base
            ours += row["count"] * (min(base, mine) if keeps_faster else mine)
        out[kind] = {"pytorch_ms": theirs, "ours_ms": ours, "speedup": theirs / ours if ours > 0 else None}
    theirs = out["attention"]["pytorch_ms"] + out["linear"]["pytorch_ms"]
    ours = out["attention"]["ours_ms"] + out["linear"]["ours_ms"]
    out["both"] = {"pytorch_ms": theirs, "ours_ms": ours, "speedup": theirs / ours if ours > 0 else None}
    forward = result.get("forward_ms")
    if forward and theirs and forward > theirs:
        out["forward"] = {"measured_ms": forward, "share": theirs / forward,
                          "predicted_ms": forward - theirs + ours, "speedup": forward / (forward - theirs + ours)}
    return out


def run_benchmark(attention: list, linear: list, device, *, attention_paths: list, linear_method: Optional[str],
                  linear_extensions: tuple = (), attention_keeps_faster: bool = False, baseline=sdpa_attention,
                  baseline_label: str = "PyTorch SDPA", repeats: int = 20, notes: Optional[list] = None,
                  progress: Optional[Callable[[int, int, str], None]] = None, source: str = "",
                  forward_ms: Optional[float] = None) -> dict:
    """Time every (shape, count) of `attention` and `linear`; the JSON-ready result.

    attention_keeps_faster: the settings' attention decision times ours against ComfyUI's per
    shape and keeps the faster (auto), so the per-forward estimate takes the faster of the two.
    """
    device = torch.device(device)
    timer = Timer(device, repeats)
    total, done = len(attention) + len(linear), 0
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"version": RESULT_VERSION, "created": created, "source": source, "device": str(device),
              "device_name": _device_name(device), "torch": torch.__version__, "triton": kernels.triton_version(),
              "timer": timer.name, "interpreter": device.type == "cpu" and kernels.interpreter_enabled(),
              "attention_paths": list(attention_paths), "attention_keeps_faster": bool(attention_keeps_faster),
              "linear_method": linear_method, "linear_extensions": list(linear_extensions),
              "notes": list(notes or []), "forward_ms": forward_ms,
              "attention": [], "linear": []}
    if result["interpreter"] and (attention_paths or linear_method):
        result["notes"].append("our kernels ran in the Triton interpreter (TRITON_INTERPRET=1): their times are "
                               "not speeds, only a check that they run and agree")
    for kind, items in (("attention", attention), ("linear", linear)):
        for shape, count in items:
            log.info("Triton Accel benchmark: %s %s (x%d per forward)", kind, shape.label, count)
            with torch.no_grad():
                row = (bench_attention(shape, count, device, timer, baseline, baseline_label, attention_paths)
                       if kind == "attention" else bench_linear(shape, count, device, timer, linear_method,
                                                                tuple(linear_extensions)))
            result[kind].append(row)
            done += 1
            if progress is not None:
                progress(done, total, f"{kind} {shape.label}")
    result["summary"] = summarize(result)
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except Exception:  # a broken driver must not lose the measurements
            return "CUDA device"
    return device.type.upper()


# ---- text --------------------------------------------------------------------------------------

def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


TABLE_HEADER = ("kind", "shape", "calls", "implementation", "ms", "TFLOP/s", "x PyTorch", "rel L2")
TABLE_WIDTHS = (9, 44, 5, 24, 9, 8, 9, 8)
TABLE_LEFT = (True, True, False, True, False, False, False, False)  # left-aligned columns


def table_rows(result: dict) -> list:
    """[(cells, error, speed-up)] per implementation: 8 cells (an error fills the 5th, the rest
    blank), the error flag, and on each shape's first row our best accurate speed-up (or None)."""
    rows = []
    for kind in ("attention", "linear"):
        for row in result.get(kind, []):
            base = row["results"][0]["ms"]
            best = best_ours(row)
            for i, r in enumerate(row["results"]):
                lead = (kind, row["label"], str(row["count"])) if i == 0 else ("", "", "")
                speedup = (base / best["ms"] if best and base and best["ms"] else None) if i == 0 else None
                if r["error"]:
                    rows.append((lead + (r["label"], r["error"][:100], "", "", ""), True, speedup))
                    continue
                speed = base / r["ms"] if base and r["ms"] else None
                off = "" if r["rel_l2"] is None or within_bar(row, r) else "*"  # outside its bar: not counted
                rows.append((lead + (r["label"], _fmt(r["ms"], ".3f"), _fmt(r["tflops"], ".1f"),
                                     _fmt(speed, ".2f") + "x", _fmt(r["rel_l2"], ".1e") + off), False, speedup))
    return rows


def table_lines(result: dict) -> list:
    """The per-shape table as fixed-width text: one line per implementation."""
    def line(cells, error=False):
        out = []
        for j, (cell, width, left) in enumerate(zip(cells, TABLE_WIDTHS, TABLE_LEFT)):
            if error and j == 4:
                out.append(cell)
                break
            cell = cell[:width]
            out.append(cell.ljust(width) if left else cell.rjust(width))
        return " ".join(out).rstrip()
    return [line(TABLE_HEADER)] + [line(cells, error) for cells, error, _ in table_rows(result)]


def header_lines(result: dict) -> list:
    """What comes before the table: device, what was recorded, notes, the per-forward summary."""
    head = [f"Triton Accel benchmark on {result['device_name']} ({result['device']}), torch {result['torch']}, "
            f"Triton {result['triton'] or 'not installed'}; timer: {result['timer']}"]
    if result.get("source"):
        head.append(f"source: {result['source']}")
    n_attn = sum(r["count"] for r in result["attention"])
    n_lin = sum(r["count"] for r in result["linear"])
    head.append(f"recorded: {len(result['attention'])} attention shapes ({n_attn} calls), "
                f"{len(result['linear'])} Linear shapes ({n_lin} calls)")
    return head + [f"note: {n}" for n in result.get("notes", [])] + bar_lines(result) + summary_lines(result)


def bar_lines(result: dict) -> list:
    """The accuracy bars the run judged by (vs the float32 reference), one line."""
    bars = {}
    for row in result.get("attention", []):
        for r in row["results"][1:]:
            if "bar" in r:
                b = r["bar"]
                bars[r["label"]] = f"rel. L2 <= {b['max_rel_l2']:g}" + (
                    f" and worst-head cosine >= {b['min_cosine']:g}" if b.get("min_cosine") is not None else "")
    for row in result.get("linear", []):
        if len(row["results"]) > 1 and row["results"][1].get("error") is None:
            bars.setdefault(row["results"][1]["label"], f"rel. L2 <= {row['max_rel_l2']:g}")
    if not bars:
        return []
    return ["accuracy bar vs float32 (auto's and the Linear guard's; * = outside it, not counted): "
            + "; ".join(f"{label}: {bar}" for label, bar in bars.items())]


def summary_lines(result: dict) -> list:
    s = result.get("summary") or summarize(result)
    lines = []
    for kind, name in (("attention", "attention"), ("linear", "Linear"), ("both", "attention + Linear")):
        part = s[kind]
        if part["pytorch_ms"]:
            lines.append(f"{name}: {part['pytorch_ms']:.2f} ms per forward with PyTorch, {part['ours_ms']:.2f} ms "
                         f"with ours -> {_fmt(part['speedup'], '.2f')}x")
    if "forward" in s:
        f = s["forward"]
        lines.append(f"whole forward: measured {f['measured_ms']:.1f} ms (first call, overheads included), "
                     f"{100 * f['share']:.0f}% in these calls; predicted {f['predicted_ms']:.1f} ms "
                     f"-> {f['speedup']:.2f}x")
    return lines


def report_text(result: dict) -> str:
    """What the node shows and the command line prints: header, notes, summary, table."""
    return "\n".join(header_lines(result) + [""] + table_lines(result))
