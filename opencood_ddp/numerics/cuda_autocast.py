"""CUDA's autocast cast lists for CPU tensors, so that a half-precision step's operators can be counted on a machine
without a GPU as a GPU dispatches them (engine/census.py, issue 52 item 4).

Why: autocast's lists differ by device. On CUDA, ``exp``, ``log``, ``pow``, ``layer_norm``, the losses, ``softmax``
and ``sum`` run in float32 (their 16-bit inputs cast up first), ``addcmul`` and ``index_put`` promote to the widest
input, and ``cat`` and ``stack`` are not autocast at all (they promote by themselves, in one op). On the CPU none
of the former are cast, while ``cat``, ``stack`` and ``index_copy`` cast their inputs first (one ``_to_copy`` each).
A count under the CPU's lists is therefore not the CUDA step's: each cast is an operator, and on a GPU a launch.

How: the CPU build of torch carries CUDA's autocast kernels too (registered on the ``AutocastCUDA`` key, which a
CPU tensor never reaches). ``cuda_autocast_on_cpu`` registers, for every op that has a kernel on either key and
whose CPU kernel does not already cast as CUDA's (``CPU_KERNEL_AS_CUDA``: the convolutions and matrix products), a
kernel on ``AutocastCPU`` that applies CUDA's policy for that op, as torch's C++ wrappers do
(``aten/src/ATen/autocast_mode.h``): cast eligible inputs (floating, on the CPU, not float64) to the autocast type
(``LOWER``), to float32 (``FP32``), or to the widest of them (``PROMOTE``); pass float32 as a missing ``dtype``
(``FP32_SET_OPT_DTYPE``) or call the ``dtype`` overload (``FP32_APPEND_DTYPE``); refuse (``BANNED``); or cast
nothing where CUDA has no kernel (``NONE``). The 16-bit type is the CPU autocast's (``torch.autocast("cpu",
dtype=...)``). The weights' casts of the ops left to the CPU's kernels come from autocast's own cache, once per
forward as on CUDA; the few ops cast here keep a cache of their own (``_CastCache``), emptied with autocast's:
inside the context ``torch.clear_autocast_cache``, which autocast's outermost exit calls, empties both.

What stays the CPU's: where an op's own kernel decomposes by device below autocast. A float16 ``softmax`` with
dtype float32 is one ``_softmax(x, dim, half_to_float=True)`` on CUDA and a ``_to_copy`` and a ``_softmax`` on the
CPU (bfloat16 takes the latter on both).

The registration is process-wide while the context is open (the dispatcher's tables are global), unlike
``kernel_path.cuda_kernels_on_cpu``; it is for counting tools and tests, not for training. Leaving the context
removes it, and the CPU's own autocast kernels serve again.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED, NONE = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "none")

# CUDA's policy by op ("name" or "name.overload"), as torch's autocast_mode.h/.cpp register them for CUDA.
_CUDA_LISTS: Dict[str, Tuple[str, ...]] = {
    LOWER: ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
            "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
            "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
            "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
            "cudnn_convolution", "cudnn_convolution_transpose",
            # CUDA builds only (the CPU build has no cuDNN): cudnn/RNN.cpp's own AutocastCUDA kernel casts to the
            # 16-bit type and re-flattens the weights; torch 2.11+cu130 registers it
            "_cudnn_rnn"),
    FP32: ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
           "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
           "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
           "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
           "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
           "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
           "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
           "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
           "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
           "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
    FP32_SET_OPT_DTYPE: ("prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname",
                         "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum",
                         "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
                         "sum", "sum.dim_IntList", "sum.dim_DimnameList"),
    FP32_APPEND_DTYPE: ("norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim"),
    PROMOTE: ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
              "tensordot", "scatter_add"),
    BANNED: ("binary_cross_entropy",),
}
CUDA_POLICY: Dict[str, str] = {op: policy for policy, ops in _CUDA_LISTS.items() for op in ops}
# Ops the CPU's own autocast kernels cast to the 16-bit type as CUDA's do (autocast_mode.cpp's CPU list): left to
# them, so that a weight's cast comes from autocast's own cache, cleared as a forward's outermost autocast exits.
CPU_KERNEL_AS_CUDA = frozenset((
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "_convolution.deprecated", "prelu", "addmm", "addbmm", "baddbmm", "bmm", "mm", "matmul", "linear",
    "linalg_vecdot", "scaled_dot_product_attention"))
# norm's dtype overloads, which CUDA's fp32_append_dtype wrappers call with dtype float32
_APPENDED = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
             "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_lock = threading.Lock()
_open: Dict[str, Any] = {"depth": 0, "library": None, "clear": None}


class UnknownCudaAutocastOp(RuntimeError):
    """This torch autocasts an op on CUDA that ``CUDA_POLICY`` does not list: its policy must be added."""


def _registered(dispatch_key: str) -> List[str]:
    """The aten ops ("name" or "name.overload") with a kernel of their own on ``dispatch_key``."""
    return [name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)]


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(value: Any) -> bool:
    """CUDA's autocast eligibility, for a CPU tensor: floating point and not float64."""
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_floating_point()
            and value.dtype != torch.float64)


class _CastCache:
    """Casts of float32 leaf weights that require a gradient to the 16-bit type, made once per forward however often
    the forward uses the weight, as autocast's cache does: it is emptied when torch empties autocast's (the
    outermost autocast context's exit). Only the ops CUDA casts down and the CPU does not (``einsum``,
    ``convolution``, ``mv``, the RNN cells, ...) use it."""

    def __init__(self):
        # keyed by id, as autocast's by TensorImpl: a tensor's == is elementwise. The weak reference tells a live
        # weight from a new tensor that took a dead one's id.
        self._casts: Dict[int, Tuple["weakref.ref[torch.Tensor]", torch.Tensor]] = {}

    def clear(self) -> None:
        self._casts.clear()

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if value.dtype == dtype or not _eligible(value):
            return value
        cacheable = (dtype != torch.float32 and value.dtype == torch.float32 and value.requires_grad
                     and value.is_leaf and not value._is_view())
        if not cacheable:
            return value.to(dtype)
        hit = self._casts.get(id(value))
        if hit is not None and hit[0]() is value and hit[1].dtype == dtype:
            return hit[1]
        cast = value.to(dtype)
        self._casts[id(value)] = (weakref.ref(value), cast)
        return cast


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``fn`` on a tensor argument and on each tensor of a list argument (TensorList, Tensor?[])."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _promoted(values, lower: torch.dtype) -> torch.dtype:
    """autocast's ``promote_type``: float32 if any eligible input is float32, else the 16-bit type."""
    widest = lower
    for t in _tensors(values):
        if _eligible(t) and t.dtype == torch.float32:
            widest = torch.float32
        elif _eligible(t) and t.dtype != lower and widest != torch.float32:
            raise RuntimeError(f"autocast: a {t.dtype} input beside {lower} has no promotion rule")
    return widest


def _first_tensor(args) -> Optional[torch.Tensor]:
    return next(_tensors(args), None)


class _Kernel:
    """The AutocastCPU kernel of one op under CUDA's ``policy``; it runs the op below autocast."""

    def __init__(self, name: str, policy: str, cache: _CastCache):
        self.name, self.policy, self.cache = name, policy, cache
        self.op = _overload(name)
        arguments = self.op._schema.arguments
        self.dtype_at = next((i for i, a in enumerate(arguments) if a.name == "dtype"), None)
        self.dtype_kwarg_only = self.dtype_at is not None and arguments[self.dtype_at].kwarg_only

    def __call__(self, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return self._run(list(args), dict(kwargs))

    def _run(self, args: list, kwargs: dict):
        lower = torch.get_autocast_dtype("cpu")
        if self.policy == BANNED:
            raise RuntimeError(f"aten::{self.name} is unsafe to autocast (on CUDA); use the _with_logits form")
        if self.policy in (LOWER, FP32, PROMOTE):
            if self.policy == PROMOTE:
                dtype = _promoted([*args, *kwargs.values()], lower)
            else:
                dtype = lower if self.policy == LOWER else torch.float32
            args = [_map_tensors(lambda t: self.cache.cast(t, dtype), a) for a in args]
            kwargs = {k: _map_tensors(lambda t: self.cache.cast(t, dtype), v) for k, v in kwargs.items()}
        elif self.policy in (FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE) and _eligible(_first_tensor(args)):
            if self.policy == FP32_APPEND_DTYPE:
                return _overload(_APPENDED[self.name])(*args, **kwargs, dtype=torch.float32)
            self._set_missing_dtype(args, kwargs)
        return self.op(*args, **kwargs)

    def _set_missing_dtype(self, args: list, kwargs: dict) -> None:
        """float32 as the op's ``dtype`` where the call gives none (autocast's ``set_opt_dtype``)."""
        if self.dtype_kwarg_only or self.dtype_at >= len(args):
            if kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.float32
        elif args[self.dtype_at] is None:
            args[self.dtype_at] = torch.float32


def _policies() -> Dict[str, str]:
    """Every op to register on AutocastCPU: CUDA's policy for the ops CUDA autocasts, NONE for the CPU's others."""
    cuda = [name for name in _registered("AutocastCUDA") if not name.startswith("cudnn_")]
    unknown = sorted(set(cuda) - set(CUDA_POLICY))
    if unknown:
        raise UnknownCudaAutocastOp(f"torch {torch.__version__} autocasts {', '.join(unknown)} on CUDA, which "
                                    f"opencood_ddp/numerics/cuda_autocast.py's CUDA_POLICY does not list: add its "
                                    f"policy from torch's aten/src/ATen/autocast_mode.h")
    policies = {name: CUDA_POLICY[name] for name in cuda if name not in CPU_KERNEL_AS_CUDA}
    policies.update({name: NONE for name in _registered("AutocastCPU")
                     if name not in policies and name not in CPU_KERNEL_AS_CUDA})
    return policies


def _register(cache: _CastCache) -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the CPU's, restored on exit
        warnings.simplefilter("ignore")
        for name, policy in _policies().items():
            library.impl(name, _Kernel(name, policy, cache), "AutocastCPU")
    return library


def _clearing_both(clear_autocast_cache: Callable[[], None], cache: _CastCache) -> Callable[[], None]:
    """torch's ``clear_autocast_cache``, which autocast's exit calls, emptying ``cache`` too."""
    def clear() -> None:
        clear_autocast_cache()
        cache.clear()
    return clear


@contextlib.contextmanager
def cuda_autocast_on_cpu() -> Iterator[None]:
    """Within: ``torch.autocast("cpu", dtype)`` casts as CUDA's autocast does (the module's docstring); re-entrant,
    process-wide."""
    with _lock:
        if _open["depth"] == 0:
            cache = _CastCache()
            _open["library"] = _register(cache)
            _open["clear"] = torch.clear_autocast_cache
            torch.clear_autocast_cache = _clearing_both(torch.clear_autocast_cache, cache)
        _open["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _open["depth"] -= 1
            if _open["depth"] == 0:
                _open["library"]._destroy()
                torch.clear_autocast_cache = _open["clear"]
                _open["library"] = _open["clear"] = None


__all__ = ["CPU_KERNEL_AS_CUDA", "CUDA_POLICY", "UnknownCudaAutocastOp", "cuda_autocast_on_cpu"]
