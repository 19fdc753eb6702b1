"""One-pass CPU AdamW over a flat chunk that also writes the chunk's transfer copy (bf16).

The CPU step of an offloaded chunk is memory-bound: torch's fused CPU Adam reads parameter, gradient
and both moments and writes parameter and moments (28 bytes per parameter), then refreshing the bf16
copy that the next host-to-device transfer sends is a second pass (6 more bytes, and another sweep
through DRAM). This kernel does both in one pass (30 bytes). It is a few lines of C, built with the
system C compiler at first use (``cc -O3 -fopenmp``, cached under
``protrain_fx.machine.profile.cache_root()/kernels``) and called through ctypes, which releases the
GIL, so the worker thread runs it while Python goes on.

It follows torch's fused CPU Adam (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) operation by
operation (branch-free, so that it vectorizes): decoupled decay ``p *= 1 - lr*wd`` (or ``g += wd*p``
for Adam), ``m = m + (1-b1)*(g-m)`` as an fma (torch's lerp for weights below 0.5), ``v = v*b2 +
((1-b2)*g)*g``, ``p += -step_size * m / (sqrt(v)/sqrt(bc2) + eps)`` with the scalars computed in
double as torch does; the bf16 copy rounds to nearest even like ``Tensor.to``. Without a C compiler
with OpenMP, or with ``PROTRAIN_CPU_ADAM=torch``, :func:`available` is False and the optimizer keeps
torch's fused Adam plus a copy.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

from protrain_fx import config

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Branch-free inside the loops so that they vectorize: the scalars make every variant one formula
(g * +-1
   for maximize; p * (1 - lr*wd) for AdamW, else p * 1; g + p * wd for Adam only), exact where torch
   skips. */
#define ADAM_BODY(L2)                                                     \
    float gi = g[i] * grad_scale * grad_sign;                             \
    float pi = p[i] * decay_factor;                                       \
    if (L2) gi = gi + pi * l2;                                            \
    float mi = fmaf(exp_avg_coef, gi - m[i], m[i]);                       \
    float vi = v[i] * beta2 + (exp_avg_sq_coef * gi) * gi;                \
    m[i] = mi;                                                            \
    v[i] = vi;                                                            \
    float denom = sqrtf(vi) / bc2_sqrt + eps;                             \
    pi = pi + neg_step_size * mi / denom;                                 \
    p[i] = pi;

#define ADAM_LOOP(L2, OUT)                                                \
    _Pragma("omp parallel for simd num_threads(nthreads) schedule(dynamic, 16384)") \
    for (int64_t i = 0; i < n; i++) {                                     \
      ADAM_BODY(L2)                                                       \
      if (OUT) out[i] = to_bf16(pi);                                      \
    }

/* Guarded (a step taken inside backward, which may have to be taken back): an element whose
   gradient is not finite, or so large its square overflows, is left as it was and counted (the
   inverse below skips the same elements), instead of turning into NaN that no inverse can undo. */
#define UNSAFE(x) (!(fabsf(x) <= 1.0e18f))
#define ADAM_GUARDED(L2, OUT)                                             \
_Pragma("omp parallel for simd num_threads(nthreads) schedule(dynamic,16384) reduction(+:nbad)") \
    for (int64_t i = 0; i < n; i++) {                                     \
      float g0 = g[i], p0 = p[i], m0 = m[i], v0 = v[i];                   \
      float gi = g0 * grad_scale * grad_sign;                             \
      float pi = p0 * decay_factor;                                       \
      if (L2) gi = gi + pi * l2;                                          \
      float mi = fmaf(exp_avg_coef, gi - m0, m0);                         \
      float vi = v0 * beta2 + (exp_avg_sq_coef * gi) * gi;                \
      float denom = sqrtf(vi) / bc2_sqrt + eps;                           \
      pi = pi + neg_step_size * mi / denom;                               \
      int bad = UNSAFE(g0);                                               \
      pi = bad ? p0 : pi;                                                 \
      m[i] = bad ? m0 : mi;                                               \
      v[i] = bad ? v0 : vi;                                               \
      p[i] = pi;                                                          \
      nbad += bad;                                                        \
      if (OUT) out[i] = to_bf16(pi);                                      \
    }

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;      /* round to nearest even */
  uint32_t quiet_nan = (u >> 16) | 0x40u;                          /* NaN stays a quiet NaN */
  return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

int64_t protrain_adam_bf16(float* restrict p, const float* restrict g, float* restrict m, float*
restrict v,
                        uint16_t* restrict out, int64_t n, float grad_scale, float grad_sign,
                        float decay_factor,
                        float l2, float exp_avg_coef, float beta2, float exp_avg_sq_coef, float
                        neg_step_size, float bc2_sqrt, float eps, int nthreads, int guard) {
  int64_t nbad = 0;
  if (guard) {
    if (out && l2 != 0.0f) { ADAM_GUARDED(1, 1) }
    else if (out)          { ADAM_GUARDED(0, 1) }
    else if (l2 != 0.0f)   { ADAM_GUARDED(1, 0) }
    else                   { ADAM_GUARDED(0, 0) }
    return nbad;
  }
  if (out && l2 != 0.0f) { ADAM_LOOP(1, 1) }
  else if (out)          { ADAM_LOOP(0, 1) }
  else if (l2 != 0.0f)   { ADAM_LOOP(1, 0) }
  else                   { ADAM_LOOP(0, 0) }
  return nbad;
}

#define SNAP 4.76837158203125e-07 /* 2^-21: four float32 units in the last place */

/* The step above taken back, in double (hybrid_optim's take-back of a provisional step): the same
   operations, in the same order, as chunk_adam._adam_inverse's float64 tensors, so the same values;
   the scalars come computed as Python computes them there. */
void protrain_adam_inverse(float* restrict p, const float* restrict g, float* restrict m,
                           float* restrict v, int64_t n, double grad_sign, double step_scale,
                           double bc2_sqrt, double eps, double decay_divisor, double l2,
                           double one_minus_beta1, double beta1, double one_minus_beta2,
                           double beta2, int nthreads) {
  _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 16384)")
  for (int64_t i = 0; i < n; i++) {
    if (UNSAFE(g[i])) continue;  /* left as it was by the guarded step */
    double p1 = p[i], m1 = m[i], v1 = v[i], gr = (double)g[i] * grad_sign;
    double update = step_scale * m1 / (sqrt(v1) / bc2_sqrt + eps);
    double p0 = p1 + update;
    if (decay_divisor != 1.0) p0 = p0 / decay_divisor;
    if (l2 != 0.0) gr = gr + l2 * p0;
    /* moments that were 0 (an element first stepped now) come back as the step's float32
       rounding: where both are within SNAP of the rounding of the terms they are computed from,
       both are 0, as no later step may grow them into an update (one alone is a real moment) */
    double gm = one_minus_beta1 * gr, gv = one_minus_beta2 * gr * gr;
    double dm = m1 - gm, dv = v1 - gv;
    double size = fabs((double)g[i]) + fabs(l2 * p0); /* of the terms of L2's gradient sum */
    int first = fabs(dm) <= SNAP * fmax(fabs(m1), one_minus_beta1 * size) &&
                fabs(dv) <= SNAP * fmax(v1, one_minus_beta2 * fabs(gr) * size);
    double m0 = first ? 0.0 : dm / beta1;
    double v0 = first ? 0.0 : dv / beta2;
    p[i] = (float)p0;
    m[i] = (float)m0;
    v[i] = (float)(v0 < 0.0 ? 0.0 : v0);
  }
}

/* STREAM's triad, built and threaded like the step above: the host's bandwidth to compare with. */
void protrain_triad(float* restrict a, const float* restrict b, const float* restrict c, float s,
                    int64_t n, int nthreads) {
  _Pragma("omp parallel for simd num_threads(nthreads) schedule(dynamic, 16384)")
  for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_build_error: str | None = None


def _cache_dir() -> str:
    from protrain_fx.machine.profile import cache_root

    return os.path.join(cache_root(), "kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build() -> ctypes.CDLL:
    cc = config.settings().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    flags = [
        "-O3",
        "-march=native",
        "-ffp-contract=off",
        "-fno-math-errno",
        "-fopenmp",
        "-shared",
        "-fPIC",
    ]
    key = hashlib.sha256("\0".join([_SOURCE, cc, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    d = _cache_dir()
    path = os.path.join(d, f"protrain_adam_{key}.so")
    if not os.path.exists(path):
        os.makedirs(d, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "adam.c")
            with open(src, "w") as f:
                f.write(_SOURCE)
            out = os.path.join(tmp, "adam.so")
            r = subprocess.run(
                [cc, *flags, src, "-o", out, "-lm"], capture_output=True, text=True, timeout=120
            )
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
            shutil.move(out, path + f".{os.getpid()}.tmp")
            os.replace(path + f".{os.getpid()}.tmp", path)
    lib = ctypes.CDLL(path)
    fn = lib.protrain_adam_bf16
    fn.restype = ctypes.c_int64
    fn.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 10 + [ctypes.c_int] * 2
    )
    inverse_fn = lib.protrain_adam_inverse
    inverse_fn.restype = None
    inverse_fn.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_double] * 10 + [ctypes.c_int]
    )
    triad_fn = lib.protrain_triad
    triad_fn.restype = None
    triad_fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    return lib


def triad(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: float) -> None:
    """``a = b + s * c`` over contiguous fp32 CPU tensors of one length, with the kernel's build
    and threads (only where :func:`available`)."""
    n = a.numel()
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n for t in (b, c)):
        raise ValueError("triad needs contiguous fp32 CPU tensors of one length")
    _lib.protrain_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), s, n, torch.get_num_threads())


def available() -> bool:
    """Whether the one-pass kernel can be used (built on first call)."""
    global _lib, _tried, _build_error
    if config.cpu_adam_choice() == "torch":
        return False
    if _tried:  # decided (built or not): no lock on the per-chunk path
        return _lib is not None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except Exception as e:  # no compiler, no OpenMP: torch's fused Adam and a copy instead
                _build_error = f"{type(e).__name__}: {e}"
    return _lib is not None


def build_error() -> str | None:
    return _build_error


def _check_flat(what: str, tensors, n: int) -> None:
    for t in tensors:
        if (
            t.dtype != torch.float32
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or t.numel() != n
        ):
            raise ValueError(f"{what} needs contiguous fp32 CPU tensors of one length")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out_bf16: torch.Tensor | None,
    step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    grad_scale: float = 1.0,
    guard: bool = False,
) -> int:
    """One Adam/AdamW step (``step`` is the count after this step, as torch increments before use)
    on flat, contiguous fp32 CPU tensors, writing ``out_bf16`` (same length, bfloat16) when given.
    ``grad_scale``: the gradient is multiplied by it (in float32, rounded once, as ``grad.mul_``
    would) as it is read; ``grad`` itself is not written. ``guard``: elements whose gradient is not
    finite (or above 1e18) are left as they were; returns how many (see the source)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    n = param.numel()
    _check_flat("adam_step", tensors, n)
    if out_bf16 is not None and (
        out_bf16.dtype != torch.bfloat16 or not out_bf16.is_contiguous() or out_bf16.numel() != n
    ):
        raise ValueError("out_bf16 must be a contiguous bfloat16 tensor of the parameter's length")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return _lib.protrain_adam_bf16(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out_bf16.data_ptr() if out_bf16 is not None else None,
        n,
        grad_scale,
        -1.0 if maximize else 1.0,
        1 - lr * weight_decay if decoupled and weight_decay != 0 else 1.0,
        0.0 if decoupled else weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        -(lr / bias_correction1),
        bias_correction2**0.5,
        eps,
        torch.get_num_threads(),
        int(guard),
    )


def adam_inverse(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    group: dict,
) -> None:
    """Take back the Adam/AdamW step number ``step`` with a param group's hyperparameters
    (``betas``, ``lr``, ``weight_decay``, ``eps``, ``maximize``, ``decoupled_weight_decay``) on
    flat, contiguous fp32 CPU tensors, in double, as ``chunk_adam._adam_inverse`` does with float64
    tensors (the same values, at the host's memory bandwidth instead of a pass per operation)."""
    n = param.numel()
    _check_flat("adam_inverse", (param, grad, exp_avg, exp_avg_sq), n)
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    decoupled, maximize = group["decoupled_weight_decay"], group["maximize"]
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    _lib.protrain_adam_inverse(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        -1.0 if maximize else 1.0,
        lr / bc1,
        math.sqrt(bc2),
        float(group["eps"]),
        1 - lr * weight_decay if decoupled and weight_decay != 0 else 1.0,
        weight_decay if not decoupled else 0.0,
        1 - beta1,
        beta1,
        1 - beta2,
        beta2,
        torch.get_num_threads(),
    )
