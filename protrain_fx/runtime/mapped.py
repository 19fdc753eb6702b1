"""Host memory that the compute device addresses directly: what an offloaded parameter and its
gradient are.

An offloaded chunk's values live in host memory (its master copy, its gradient accumulator). Its
``nn.Parameter`` is a view of that memory *on the compute device*: on a CUDA device a tensor whose
data pointer is the pinned host buffer itself (unified virtual addressing: kernels read and write
host memory over the bus), on the CPU a second tensor over the same storage. So everything eager
PyTorch does with a parameter gives the right answer, only slower where it runs: ``print(p)``,
``p.norm()``, ``p.mul_(0.9)`` under ``no_grad``, ``model.state_dict()``, ``load_state_dict``,
another optimizer stepping it, a graph that dynamo runs eagerly. The compiled graphs never read it
(they gather the low-precision copy into device buffers); the chunk store notices writes through the
parameter's version counter and refreshes its copies.

Each view has a storage of its own that starts at the parameter's first element, as the parameter
dynamo traced had, and a version counter of its own, so protrain's own writes into the host tensors
(the CPU optimizer step, gradient copies) are not mistaken for the user's.

:class:`HostGrad` is the gradient view: ``param.grad`` of an offloaded parameter. It calls back
before any torch operation that writes it (clipping, unscaling, ``zero_()``), so that an optimizer
step protrain already applied inside backward can be taken back first
(protrain_fx/runtime/hybrid_optim.py), and says so of a multiply by exactly one, which changes
nothing (protrain_fx/runtime/overlap.py) and is not run at all. A multiply by another scalar
(clipping) is not run through the view either: the chunk store keeps the factor pending and applies
it before anything reads the gradient, or in the CPU optimizer's pass; and the 2-norm clipping
takes of it first is the one backward computed as the gradient left the device, while the gradient
is unchanged (protrain_fx/runtime/grad_scale.py).
"""

from __future__ import annotations

import ctypes

import torch
from torch.utils._pytree import tree_flatten


class _CudaInterface:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at ``offset`` into a pinned host buffer, as
    raw bytes; torch.as_tensor keeps it (and so the buffer) alive as long as the device tensor it
    makes."""

    def __init__(self, host: torch.Tensor, offset: int, nbytes: int):
        # ``host`` keeps the memory alive
        self.host, self.offset, self.nbytes = host, offset, nbytes

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.host.data_ptr() + self.offset, False),
            "version": 2,
            "strides": None,
        }


@torch.enable_grad()  # a view made in backward (grad mode off) could not be written with it on
def device_view(host: torch.Tensor, offset: int, shape, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` of ``shape`` over the memory of the contiguous host tensor ``host``
    from element ``offset`` on (pinned when ``device`` is CUDA). It has a storage of its own that
    starts there (storage offset 0, like the parameter dynamo traced) and a version counter of its
    own, and it keeps ``host`` alive."""
    if not host.is_contiguous():
        raise ValueError("device_view needs a contiguous host tensor")
    shape = torch.Size(shape)
    numel, elem = shape.numel(), host.element_size()
    if numel == 0:
        return torch.empty(shape, dtype=host.dtype, device=device)
    nbytes = numel * elem
    if device.type == "cpu":
        raw = (ctypes.c_char * nbytes).from_address(host.data_ptr() + offset * elem)
        raw.owner = host
        return torch.frombuffer(raw, dtype=host.dtype).view(shape)
    if device.type != "cuda":
        from protrain_fx.errors import ProtrainError

        raise ProtrainError(
            f"protrain offloads to the host from CUDA or CPU devices only, not {device.type}"
        )
    raw = torch.as_tensor(_CudaInterface(host, offset * elem, nbytes), device=device)
    return raw.view(host.dtype).view(shape)


class HostGrad(torch.Tensor):
    """``param.grad`` of an offloaded parameter: a view of its chunk's host gradient accumulator
    (see the module docstring). ``on_write(grads)`` runs before any torch function that writes one
    of them in place; results of other functions are plain tensors."""

    on_write = None  # set by the chunk store: callable(list of HostGrad about to be written)
    on_identity = None  # callable(list of HostGrad multiplied by exactly one): runtime/overlap.py
    # callable(list of HostGrad, scale) -> bool: their multiply by a scalar kept pending by the
    # chunk store (True) instead of run through the device views (runtime/chunk_grads.py)
    defer_scale = None
    # callable(list of HostGrad, drop: bool): pending factors applied before a function reads the
    # gradients (dropped before ``zero_``)
    settle = None
    # callable(HostGrad, Tensor): a function returned a plain tensor over its memory (``detach()``,
    # ``.data``, a view), which a pending factor would not reach: its multiplies run as they come
    on_alias = None
    # callable(args, kwargs) -> Tensor | None: ``torch.linalg.vector_norm`` of a gradient as
    # backward computed it (clipping's norm without reading host memory), or None
    cached_norm = None
    forget_norms = None  # callable(list of HostGrad): about to be written, those norms go

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], HostGrad) and (own := _own_meaning(func, args)):
            return own()
        if func is torch.linalg.vector_norm and HostGrad.cached_norm is not None:
            out = HostGrad.cached_norm(args, kwargs)
            if out is not None:
                return out
        held = ()
        if HostGrad.settle is not None and _reads_data(func, args):
            held = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, HostGrad)]
            if held:
                HostGrad.settle(held, getattr(func, "__name__", "") in ("zero_", "_foreach_zero_"))
        # what an in-place function writes is its first argument (a tensor, or the list of a
        # foreach op), or its ``out=``
        written = []
        if _writes(func) and args:
            written = [a for a in tree_flatten(args[0])[0] if isinstance(a, HostGrad)]
        scale = _scale(func, args) if written else None
        out = [a for a in tree_flatten(kwargs.get("out"))[0] if isinstance(a, HostGrad)]
        if HostGrad.forget_norms is not None and (written and scale != 1.0 or out):
            HostGrad.forget_norms(written + out)
        if HostGrad.on_write is not None and out:
            HostGrad.on_write(out)
        if HostGrad.on_write is not None and written:
            if scale != 1.0:
                HostGrad.on_write(written)
                if scale is not None and HostGrad.defer_scale is not None:
                    if HostGrad.defer_scale(written, scale):
                        return _the_others(func, args, kwargs)
            else:
                out = _unchanged(func, args, kwargs, written)
                if HostGrad.on_identity is not None:
                    HostGrad.on_identity(written)
                return out
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if held and HostGrad.on_alias is not None:
            # an attribute (torch's own ``._base`` while it fakes a tensor) is no alias to write
            _note_aliases(out, held, getattr(func, "__name__", "") != "__get__")
        return out


def _own_meaning(func, args):
    """What a HostGrad does itself, as a thunk, where torch's own would lose its memory or fail
    on a view: ``g.data`` is ``g.detach()`` (its writes then share the view's version counter,
    which is how a provisional step learns of them, runtime/overlap.py), ``g.data = t`` copies
    ``t`` into the host gradient (as a write through the view), ``g.detach_()`` of a gradient
    without autograd history changes nothing (torch refuses it of a view)."""
    name = getattr(func, "__name__", "")
    g = args[0]
    if name in ("__get__", "__set__") and getattr(func, "__self__", None) is torch.Tensor.data:
        if name == "__get__":
            return g.detach
        t = args[1]
        if not isinstance(t, torch.Tensor) or t.shape != g.shape or t.dtype != g.dtype:
            from protrain_fx.errors import ProtrainError

            raise ProtrainError(
                "protrain: `.grad.data = t` of an offloaded parameter takes a tensor of the "
                "gradient's shape and dtype (its values are copied into the host gradient)"
            )
        return lambda: _copy_into(g, t)
    if name == "detach_" and not g.requires_grad:
        return lambda: g
    return None


@torch.no_grad()
def _copy_into(g, t) -> None:
    g.copy_(t)


def _note_aliases(out, held, writable: bool) -> None:
    """Tell of each HostGrad among ``held`` whose memory a plain tensor of ``out`` shares (and,
    ``writable``, that eager code may write it through that tensor)."""
    tensors = [t for t in tree_flatten(out)[0] if type(t) is torch.Tensor]
    if not tensors:
        return
    with torch._C.DisableTorchFunctionSubclass():
        base = {g.untyped_storage().data_ptr(): g for g in held}
        shared = [base.get(t.untyped_storage().data_ptr()) for t in tensors]
    for g, t in zip(shared, tensors):
        if g is not None:
            HostGrad.on_alias(g, t)
    shared = [g for g in shared if g is not None]
    if writable and shared and HostGrad.on_write is not None:  # writes would come unseen
        HostGrad.on_write(shared)


def _scale(func, args) -> float | None:
    """The factor of a multiply of gradients by one scalar (``mul_``, ``_foreach_mul_``:
    clipping's ``clip_grad_norm_``, a hand-written scale) as the float32 that multiplies them, else
    None. Reading a device scalar synchronizes; the gradients are complete by then anyway. A
    multiply by exactly one changes nothing (``clip_grad_norm_`` with a norm under ``max_norm``;
    Hugging Face's Trainer calls it with ``max_norm=inf`` every step to log the norm)."""
    if getattr(func, "__name__", "") not in ("mul_", "_foreach_mul_") or len(args) < 2:
        return None
    scale = args[1]
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        return None
    if isinstance(scale, torch.Tensor):
        if (
            scale.numel() != 1
            or isinstance(scale, HostGrad)
            or not scale.is_floating_point()
            or scale.requires_grad
        ):
            return None
        with torch._C.DisableTorchFunctionSubclass():
            scale = scale.item()
    return torch.tensor(scale, dtype=torch.float32).item()


def _unchanged(func, args, kwargs, grads):
    """A multiply by exactly one (``clip_grad_norm_`` under ``max_norm``, or with ``max_norm=inf``
    to log the norm): ``x * 1.0`` is ``x`` for every float, so the gradients' host memory is not
    read and written over the link; their versions move as the write's would. The other tensors
    of the call are multiplied as usual."""
    with torch._C.DisableTorchFunctionSubclass():
        for g in grads:
            torch.autograd.graph.increment_version(g)
    return _the_others(func, args, kwargs)


def _the_others(func, args, kwargs):
    """Run an in-place multiply on the tensors of its first argument that are not HostGrads (their
    multiply is pending in their chunk store); returns what the function returns."""
    first = args[0]
    if isinstance(first, HostGrad):
        return first
    rest = [t for t in first if not isinstance(t, HostGrad)]
    if rest:
        with torch._C.DisableTorchFunctionSubclass():
            func(rest, *args[1:], **kwargs)
    return list(first)


# reading these reads no gradient values
_METADATA = frozenset(
    "shape dtype device is_cuda requires_grad grad_fn is_leaf layout ndim _version size dim numel "
    "stride is_contiguous element_size nelement is_floating_point is_complex __len__".split()
)


def _reads_data(func, args) -> bool:
    """Whether a torch function may read its HostGrad arguments' values (not a property such as
    ``.shape`` or ``.device``, nor ``param.grad = g``, which stores the view)."""
    name = getattr(func, "__name__", "") or ""
    if name in ("__get__", "__set__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if attr in _METADATA:
            return False
        return not (name == "__set__" and args and not isinstance(args[0], HostGrad))
    return name not in _METADATA


def _writes(func) -> bool:
    """Whether a torch function may write its first argument(s) in place (``mul_``,
    ``_foreach_mul_``, ``copy_``, ``zero_``, torch's amp unscale)."""
    name = getattr(func, "__name__", "") or ""
    if name == "__set__":  # setting an attribute such as .data
        return True
    return (
        name.endswith("_")
        and not name.endswith("__")
        or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
    )


def host_grad(view: torch.Tensor) -> HostGrad:
    """Wrap a gradient view (sharing its storage and version counter) as a :class:`HostGrad`.
    Both made with grad mode on, though backward runs without it: ``p.grad.add_(p)`` (weight decay
    by hand, grad mode on) is then allowed, as of eager's leaf gradient."""
    with torch.enable_grad():
        return view.as_subclass(HostGrad)
