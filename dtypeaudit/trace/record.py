"""Record every aten operation of a forward (and backward) pass: its module, input and output dtypes, the casts
autocast inserted, and the operations that fail.

The same recorder runs on fake tensors (``dtypeaudit trace``) and on real ones (the tests that hold the trace
to reality). A ``TorchDispatchMode`` sees each operation below autograd and autocast, so it sees the casts
autocast inserts; module forward hooks keep the stack of modules; in backward, the autograd node that runs
an operation names the forward module that made it (by its sequence number).

Fake tensors carry no values, and their kernels (torch's meta functions) check shapes more carefully than
dtypes: a meta ``addmm`` promotes an fp16 weight against an fp32 input where the CPU kernel raises "mat1 and
mat2 must have the same dtype". So with ``probe=True`` each operation whose dtypes could matter (mixed
floating dtypes, half precision, or a failure) is also run once on small real CPU tensors of the same dtypes,
zeros, and the CPU kernel's answer wins: its error message, or its output dtypes. A probe that fails also with
every floating input in float32 failed on its made-up shapes, not on dtypes, and is ignored. Probes are cached
by operation and dtypes, so a 7B model needs a few hundred, each on tensors of a few elements.

A failing operation is recorded with PyTorch's message, then run again with its floating inputs cast to the
dtype the user most likely meant (the mutated tensor's; else the dtype holding most of the model's parameters
where an input has it; else the weight dtype of the innermost module that holds weights; else the commonest
among the inputs), so the run goes on and every failure is reported, not the echoes of the first.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import DtypeAuditError
from .result import LOSS, NOT_PROMOTION, OUTSIDE, ROOT, GradRecord, ModuleCall, OpRecord, Phase

if TYPE_CHECKING:
    import torch

PROBE_ELEMENTS = 1 << 16
"""Probes use the real shapes when all their tensors hold at most this many elements together, else every dim is 1."""

_DTYPE_WORDS = re.compile(r"dtype|scalar type|Half|BFloat16|Float|Double|mixed", re.IGNORECASE)


class TraceStopped(DtypeAuditError):
    """The run could not go on: an operation fake tensors cannot run, or a failure that is not about dtypes."""

    def __init__(self, message: str, *, module: str | None = None, op: str | None = None) -> None:
        where = f" in module '{module or '(root)'}'" if module is not None else ""
        what = f"{op}: " if op else ""
        super().__init__(f"tracing stopped{where}: {what}{message}")
        self.module = module
        self.op = op
        self.reason = message


def first_line(exc: BaseException) -> str:
    """PyTorch's message, first non-empty line (its long explanations follow on later lines)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def _tensors(tree: Any) -> list[torch.Tensor]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors an in-place or ``out=`` operation writes to."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            out.extend(_tensors(value))
    return out


def _outputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Any]:
    """The tensors an operation returned; for backward kernels with an ``output_mask``, only those asked for
    (a meta kernel returns a tensor where the CPU kernel returns none)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "output_mask":
            mask = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            if isinstance(out, (tuple, list)) and isinstance(mask, (list, tuple)) and len(mask) == len(out):
                return [t for t, keep in zip(out, mask, strict=True) if keep and t is not None]
    return _results(out)


def _results(out: Any) -> list[Any]:
    """The tensors an operation or a module returned, leaving out the empty tensors after the first.

    Where a CPU kernel leaves an output undefined (None: _native_multi_head_attention's attention weights when they
    are not needed, and so MultiheadAttention's; mkldnn_rnn_layer's workspace), its meta kernel returns an empty
    tensor. Neither carries data, so a fake run and a real one record the same outputs.
    """
    if isinstance(out, (tuple, list)) and len(out) > 1 and _tensors(out[:1]):
        return [*_tensors(out[:1]), *(t for t in _tensors(out[1:]) if t.numel() > 0)]
    return _tensors(out)


def _returns_alias(func: Any) -> bool:
    return func.is_view or any(r.alias_info is not None for r in func._schema.returns)


@dataclass
class Recording:
    """What one run did: every operation, every module call, and after ``--backward`` the gradients."""

    ops: list[OpRecord] = field(default_factory=list)
    calls: list[ModuleCall] = field(default_factory=list)
    output: tuple[str, ...] = ()
    loss: str | None = None
    loss_dtype: str | None = None
    grads: list[GradRecord] = field(default_factory=list)
    stopped: str | None = None
    """A dtype failure raised outside any operation (Python code checking dtypes), where the run had to stop."""
    stopped_module: str | None = None
    types: dict[str, str] = field(default_factory=dict)
    """Module path -> type name, in the model's module order (modules made during forward last)."""


class Recorder:
    """Module hooks and a dispatch mode over one model; use ``with recorder.active():``."""

    def __init__(self, model: torch.nn.Module, *, probe: bool, device: str = "cpu") -> None:
        import torch

        self.model = model
        self.probe = probe
        self.device = device
        self.paths: dict[int, str] = {}
        self.types: dict[str, str] = {}
        self.weight_dtype: dict[str, Any] = {}
        for name, m in model.named_modules():
            self.paths.setdefault(id(m), name)
            self.types[name] = type(m).__name__
            floats = [p for p in m.parameters(recurse=False) if p.is_floating_point()]
            weight = getattr(m, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.is_floating_point():
                self.weight_dtype[name] = weight.dtype
            elif floats:
                self.weight_dtype[name] = Counter(p.dtype for p in floats).most_common(1)[0][0]
        self.param_owner: dict[int, str] = {}
        elements: Counter[Any] = Counter()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in self.param_owner and p.is_floating_point():
                elements[p.dtype] += p.numel()
            self.param_owner.setdefault(id(p), name.rpartition(".")[0])
        self.dominant = elements.most_common(1)[0][0] if elements else None
        """The floating dtype that holds most of the model's parameters."""
        self.recording = Recording(types=self.types)
        self.phase: Phase = "forward"
        self.stack: list[tuple[str, tuple[str, ...]]] = []
        self.extra: list[str] = []
        """Pseudo-modules pushed by the driver (the loss)."""
        self.failed_in: str | None = None
        self._seqs: list[int] = []
        self._seq_paths: list[str] = []
        self._pending_casts: list[tuple[str, str]] = []
        self._probes: dict[Any, tuple[bool, str | None, tuple[str, ...]] | None] = {}
        self.call_args: frozenset[int] = frozenset()
        """While the model's code is in a torch call that autocast may cast for (autocast on there, not a conversion,
        no dtype argument): the ids of the tensors it passed. A cast of one of them is autocast's doing."""
        self.silent = 0
        """Above zero while the recorder casts inputs itself (those casts are not the model's operations)."""

    # -- where an operation runs ---------------------------------------------------------------

    def module(self) -> str:
        if self.phase == "forward":
            if self.extra:
                return self.extra[-1]
            return self.stack[-1][0] if self.stack else ROOT
        import torch

        node = torch._C._current_autograd_node()
        if node is None:
            return OUTSIDE
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: the parameter's own module
            return self.param_owner.get(id(variable), OUTSIDE)
        at = bisect.bisect_right(self._seqs, node._sequence_nr())
        return self._seq_paths[at] if at < len(self._seq_paths) else OUTSIDE

    @contextlib.contextmanager
    def pseudo_module(self, name: str) -> Iterator[None]:
        self.extra.append(name)
        try:
            yield
        finally:
            self.extra.pop()

    # -- module hooks ----------------------------------------------------------------------------

    def _pre_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        path = self.paths[id(module)]  # hooks are only on the model's own modules
        self.stack.append((path, tuple(dtypes.name_of(t.dtype) for t in _tensors((args, kwargs)))))

    def _post_hook(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if not self.stack:
            return
        path, inputs = self.stack.pop()
        failed = output is None and sys.exc_info()[1] is not None
        if failed and self.failed_in is None:
            self.failed_in = path
        outputs = () if failed else tuple(dtypes.name_of(t.dtype) for t in _results(output))
        self.recording.calls.append(ModuleCall(path, self.types.get(path, type(module).__name__), inputs, outputs))

    @contextlib.contextmanager
    def active(self) -> Iterator[Recorder]:
        import torch

        # TransformerEncoderLayer takes its fused kernel only if no module under it has hooks of its own: those
        # modules are hooked through the global module hooks instead (which do not pass keyword arguments to a
        # pre-hook, so their keyword tensors, masks, are not among the call's inputs).
        hooks = torch.nn.modules.module
        quiet: set[int] = set()
        for m in self.model.modules():
            if isinstance(m, torch.nn.TransformerEncoderLayer):
                quiet.update(id(sub) for sub in m.modules())
        handles = []
        for m in self.model.modules():
            if id(m) not in quiet:
                handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
                handles.append(m.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))
        if quiet:

            def pre(module: Any, args: Any) -> None:
                if id(module) in quiet:
                    self._pre_hook(module, args, {})

            def post(module: Any, args: Any, kwargs: Any, output: Any) -> None:
                if id(module) in quiet:
                    self._post_hook(module, args, kwargs, output)

            handles.append(hooks.register_module_forward_pre_hook(pre))
            handles.append(hooks.register_module_forward_hook(post, with_kwargs=True, always_call=True))
        modes = _modes(self)
        try:
            with modes[0], modes[1], _fast_paths_as_without_recorder():
                yield self
        finally:
            for h in handles:
                h.remove()

    # -- one operation ---------------------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        if func.namespace == "prim" or self.silent:
            return func(*args, **kwargs)
        module = self.module()
        inputs = _tensors((args, kwargs))
        out: Any = None
        error: str | None = None
        failure: BaseException | None = None
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            _stop_if_fake_limit(exc, module, func)
            error, failure = first_line(exc), exc
        if self.probe and _worth_probing(func, inputs, error is not None):
            verdict = self._probe(func, args, kwargs)
            if verdict is not None:
                ok, message, verdict_dtypes = verdict
                if not ok:
                    error = message
                elif error is not None:
                    fixed = self._run_as(func, args, kwargs, verdict_dtypes)
                    if fixed is not None:
                        out, error = fixed, None
                else:
                    out = _recast(func, out, verdict_dtypes)
        continued = None
        if error is not None:
            out, continued = self._continue(func, args, kwargs, module, error, failure)
        outputs = _outputs(func, args, kwargs, out)
        # Autocast casts the arguments of the call it wraps, then runs it: a cast of an argument of the model's
        # current torch call (one that asks for no dtype) is autocast's, and the operation that follows uses it.
        casts: tuple[tuple[str, str], ...] = ()
        autocast_cast = (
            self.phase == "forward"
            and func is torch.ops.aten._to_copy.default
            and bool(inputs)
            and id(inputs[0]) in self.call_args
            and bool(outputs)
            and outputs[0].is_floating_point()
            and error is None
        )
        if autocast_cast:
            self._pending_casts.append((dtypes.name_of(inputs[0].dtype), dtypes.name_of(outputs[0].dtype)))
        elif self._pending_casts and not _returns_alias(func):
            casts = tuple(self._pending_casts)
            self._pending_casts.clear()
        if self.phase == "forward":
            self._seqs.append(torch._C._autograd._get_sequence_nr())
            self._seq_paths.append(module)
        nbytes = 0 if _returns_alias(func) else sum(t.numel() * t.element_size() for t in outputs)
        self.recording.ops.append(
            OpRecord(
                index=len(self.recording.ops),
                phase=self.phase,
                module=module,
                op=str(func),
                inputs=tuple(dtypes.name_of(t.dtype) for t in inputs),
                outputs=tuple(dtypes.name_of(t.dtype) for t in outputs),
                nbytes=nbytes,
                autocast_cast=autocast_cast,
                autocast_casts=casts,
                error=error,
                continued_as=dtypes.name_of(continued) if continued is not None else None,
                promotion=None if error is not None else _promotion(func, inputs, outputs, args, kwargs),
                view=bool(func.is_view),
            )
        )
        return out

    def function_failed(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception) -> Any:
        """A torch function failed above the aten level (a dtype check in a composite such as ``conv2d``, or in
        ``torch.nn.functional``'s Python): record it and go on as ``dispatch`` does, else let the exception go."""
        import torch
        from torch.utils._pytree import tree_map

        message = first_line(exc)
        inputs = _tensors((args, kwargs))
        if not isinstance(exc, (RuntimeError, TypeError, ValueError)) or not looks_like_dtype_error(message):
            raise exc
        if not any(t.is_floating_point() for t in inputs):
            raise exc
        module = self.module()
        at = len(self.recording.ops)
        name = _function_name(func)
        self.recording.ops.append(OpRecord(at, self.phase, module, name, tuple(dtypes.name_of(t.dtype) for t in inputs), (), error=message))
        intended = self._intended(None, args, kwargs, module)
        for dtype in dict.fromkeys(d for d in (intended, torch.float32) if d is not None):

            def cast(x: Any, dtype: Any = dtype) -> Any:
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                    return x.to(dtype)
                return x

            self.silent += 1
            try:
                new_args, new_kwargs = tree_map(cast, (args, kwargs))
            finally:
                self.silent -= 1
            try:
                out = func(*new_args, **new_kwargs)
            except TraceStopped:
                raise
            except Exception:
                continue
            outputs = tuple(dtypes.name_of(t.dtype) for t in _tensors(out))
            self.recording.ops[at] = replace(self.recording.ops[at], outputs=outputs, continued_as=dtypes.name_of(dtype))
            return out
        raise exc

    def _intended(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], module: str) -> Any:
        """The dtype the user most likely meant this operation to run in: the written tensor's (in-place), else the
        model's dominant dtype where one of the inputs has it, else the module's weight dtype, else the commonest."""
        written = [t for t in _mutated(func, args, kwargs) if t.is_floating_point()] if func is not None else []
        if written:
            return written[0].dtype
        floats = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
        if self.dominant is not None and self.dominant in floats:
            return self.dominant
        path = module
        while True:
            if path in self.weight_dtype:
                return self.weight_dtype[path]
            if not path or path.startswith("("):
                break
            path = path.rpartition(".")[0]
        if not floats:
            return None
        counts = Counter(floats)
        best = max(counts.values())
        return next(d for d in floats if counts[d] == best)

    def _continue(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], module: str, error: str, failure: BaseException | None
    ) -> tuple[Any, Any]:
        """Run a failed operation again with its floating inputs in the intended dtype (else float32)."""
        import torch

        intended = self._intended(func, args, kwargs, module)
        for dtype in dict.fromkeys(d for d in (intended, torch.float32) if d is not None):
            out = self._run_as(func, args, kwargs, (dtypes.name_of(dtype),), exact=False)
            if out is not None:
                return out, dtype
        raise TraceStopped(error, module=module, op=_op_name(func)) from failure

    def _run_as(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtypes: tuple[str, ...], exact: bool = True) -> Any:
        """``func`` with its floating, non-mutated inputs cast to ``dtypes[0]``, outputs cast to ``dtypes`` when ``exact``."""
        import torch
        from torch.utils._pytree import tree_map

        floats = [d for d in dtypes if d]
        if not floats:
            return None
        target = getattr(torch, floats[0], None)
        if not isinstance(target, torch.dtype) or not target.is_floating_point:
            return None
        keep = {id(t) for t in _mutated(func, args, kwargs)}

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and id(x) not in keep and x.dtype != target:
                return torch.ops.aten._to_copy.default(x, dtype=target)
            return x

        try:
            new_args, new_kwargs = tree_map(cast, (args, kwargs))
            out = func(*new_args, **new_kwargs)
        except Exception:
            return None
        return _recast(func, out, dtypes) if exact else out

    # -- probes: the CPU kernel's answer for these dtypes ----------------------------------------

    def _probe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, str | None, tuple[str, ...]] | None:
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        real_shapes = sum(t.numel() for t in tensors) <= PROBE_ELEMENTS
        key_parts: list[Any] = [func, real_shapes]
        for x in flat:
            if isinstance(x, torch.Tensor):
                key_parts.append((x.dtype, tuple(x.shape) if real_shapes else x.dim()))
            else:
                key_parts.append(repr(x))
        key = tuple(key_parts)
        if key in self._probes:
            return self._probes[key]
        from torch.utils._python_dispatch import _disable_current_modes

        def real(x: Any, dtype: Any = None) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            shape = tuple(x.shape) if real_shapes else tuple(min(int(s), 1) for s in x.shape)
            want = dtype if dtype is not None and x.is_floating_point() else x.dtype
            return torch.zeros(shape, dtype=want, device="cpu")

        verdict: tuple[bool, str | None, tuple[str, ...]] | None
        with _disable_current_modes(), torch.no_grad(), torch.autocast(self.device, enabled=False), _quiet():
            try:
                a, k = tree_unflatten([real(x) for x in flat], spec)
                out = func(*a, **k)
                verdict = (True, None, tuple(dtypes.name_of(t.dtype) for t in _tensors(out)))
            except Exception as exc:
                message = first_line(exc)
                try:
                    a, k = tree_unflatten([real(x, torch.float32) for x in flat], spec)
                    func(*a, **k)
                    verdict = (False, message, ())
                except Exception:
                    verdict = None  # the made-up shapes or values failed it, not the dtypes
        self._probes[key] = verdict
        return verdict


def _make_mode_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self, recorder: Recorder) -> None:
            super().__init__()
            self.recorder = recorder

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
            return self.recorder.dispatch(func, args, kwargs or {})

    return Mode


def _make_function_mode_class() -> type:
    from torch.overrides import TorchFunctionMode

    class FunctionMode(TorchFunctionMode):
        def __init__(self, recorder: Recorder) -> None:
            super().__init__()
            self.recorder = recorder

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            recorder = self.recorder
            recorder.call_args = _castable_args(func, args, kwargs, recorder.device)
            recorder._pending_casts.clear()
            try:
                return func(*args, **kwargs)
            except TraceStopped:
                raise
            except Exception as exc:
                return recorder.function_failed(func, args, kwargs, exc)
            finally:
                recorder.call_args = frozenset()

    return FunctionMode


_mode_classes: tuple[type, type] | None = None


@contextlib.contextmanager
def _fast_paths_as_without_recorder() -> Iterator[None]:
    """Keep the recorder from changing which kernels run.

    Eval-mode MultiheadAttention and TransformerEncoder(Layer) take their fused kernels
    (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``) only if
    ``torch.overrides.has_torch_function(tensor_args)`` is false, and that is true whenever a torch-function mode
    is active, as the recorder's is. While recording, that one lookup (they make it through the module attribute)
    answers as it would without the recorder: whether a tensor is of a subclass that overrides
    ``__torch_function__`` (fake tensors and Parameters do not).
    """
    import torch
    import torch.overrides

    original = torch.overrides.has_torch_function
    disabled = torch._C._disabled_torch_function_impl

    def has_torch_function(args: Any) -> bool:
        return any(
            type(a) is not torch.Tensor and getattr(type(a), "__torch_function__", disabled) is not disabled
            for a in args
            if isinstance(a, torch.Tensor)
        )

    torch.overrides.has_torch_function = has_torch_function
    try:
        yield
    finally:
        torch.overrides.has_torch_function = original


CONVERSIONS = frozenset({"to", "_to", "float", "half", "bfloat16", "double", "type", "type_as", "new_tensor", "copy_", "cpu", "cuda"})
"""Torch calls whose casts the model's code asked for."""


def _castable_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> frozenset[int]:
    import torch
    from torch.utils._pytree import tree_leaves

    if not torch.is_autocast_enabled(device) or getattr(func, "__name__", "") in CONVERSIONS:
        return frozenset()
    leaves = tree_leaves((args, kwargs))
    if any(isinstance(x, torch.dtype) for x in leaves):
        return frozenset()
    return frozenset(id(x) for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point())


def _modes(recorder: Recorder) -> tuple[Any, Any]:
    """The torch-function mode (failures above aten) and the dispatch mode (every aten operation)."""
    global _mode_classes
    if _mode_classes is None:
        _mode_classes = (_make_function_mode_class(), _make_mode_class())
    return _mode_classes[0](recorder), _mode_classes[1](recorder)


def _function_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__module__", None) or ""
    if owner in ("torch._C._nn", "torch._C._VariableFunctions", "torch._C._VariableFunctionsClass"):
        owner = "torch"
    qual = getattr(func, "__qualname__", name)
    if owner == "torch._tensor" or "TensorBase" in qual or owner == "torch._C":
        return f"Tensor.{name}"
    return f"{owner}.{name}" if owner else name


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


_NO_PROBE = frozenset(
    {
        "aten._to_copy",
        "aten.copy_",
        "aten.detach",
        "aten.clone",
        "aten.lift_fresh",
        "aten._local_scalar_dense",
        "aten.empty_like",
        "aten.zeros_like",
        "aten.ones_like",
        "aten.full_like",
        "aten.fill_",
        "aten.zero_",
        "aten.new_empty",
        "aten.new_zeros",
        "aten.new_ones",
        "aten.new_full",
        "aten.new_empty_strided",
        "aten.empty_strided",
        "aten.set_",
    }
)


def _op_name(func: Any) -> str:
    return ".".join(str(func).split(".")[:2])


def _worth_probing(func: Any, inputs: list[Any], failed: bool) -> bool:
    import torch

    if func.is_view or _op_name(func) in _NO_PROBE:
        return False
    floats = {t.dtype for t in inputs if t.is_floating_point()}
    if not floats:
        return False
    return failed or len(floats) > 1 or bool(floats - {torch.float32, torch.float64})


def _recast(func: Any, out: Any, dtypes: tuple[str, ...]) -> Any:
    """Give ``out``'s tensors the dtypes the CPU kernel returns, where fake tensors disagree (never for aliases)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if _returns_alias(func):
        return out
    flat, spec = tree_flatten(out)
    at = 0
    changed = False
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            want = getattr(torch, dtypes[at], None) if at < len(dtypes) else None
            at += 1
            if isinstance(want, torch.dtype) and x.dtype != want:
                flat[i] = torch.ops.aten._to_copy.default(x, dtype=want)
                changed = True
    return tree_unflatten(flat, spec) if changed else out


def _promotion(func: Any, inputs: list[Any], outputs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """``(narrow, wide)`` when a non-scalar floating input was widened by type promotion that no argument asked for."""
    import torch
    from torch.utils._pytree import tree_leaves

    if not outputs or not outputs[0].is_floating_point() or _op_name(func) in NOT_PROMOTION:
        return None
    wide = outputs[0].dtype
    floats = {t.dtype for t in inputs if t.is_floating_point()}
    if wide not in floats and len(floats) < 2:  # an operation that widens by itself (softmax's half_to_float)
        return None
    narrow = [t.dtype for t in inputs if t.is_floating_point() and t.dim() > 0 and t.dtype.itemsize < wide.itemsize]
    if not narrow or any(isinstance(x, torch.dtype) for x in tree_leaves((args, kwargs))):
        return None
    return dtypes.name_of(narrow[0]), dtypes.name_of(wide)


def _stop_if_fake_limit(exc: BaseException, module: str, func: Any) -> None:
    """Fake tensors have no values: an operation whose output depends on them cannot run."""
    from torch._subclasses import fake_tensor as ft

    if isinstance(exc, (ft.DataDependentOutputException, ft.DynamicOutputShapeException)):
        raise TraceStopped(
            f"its result depends on tensor values, which fake tensors do not have ({type(exc).__name__})",
            module=module,
            op=_op_name(func),
        ) from exc
    if isinstance(exc, ft.UnsupportedOperatorException):
        raise TraceStopped("fake tensors have no implementation of this operation", module=module, op=_op_name(func)) from exc


def looks_like_dtype_error(message: str) -> bool:
    return bool(_DTYPE_WORDS.search(message))


# -- the driver: one forward (and backward) pass ---------------------------------------------------

LOSSES = ("auto", "sum", "mean", "cross-entropy")


def run(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    autocast: Any = None,
    device: str = "cpu",
    backward: bool = False,
    loss: str = "auto",
    probe: bool = False,
) -> Recording:
    """Run ``model(*args, **kwargs)`` under the recorder (and ``torch.autocast(device, autocast)``), then the loss and
    its backward pass when ``backward``. Fake or real depends only on the tensors (and the mode the caller entered)."""
    import torch

    recorder = Recorder(model, probe=probe, device=device)
    rec = recorder.recording

    def cast_ctx() -> Any:
        return torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()

    with recorder.active():
        loss_tensor = None
        try:
            with cast_ctx():
                output = model(*args, **kwargs)
                rec.output = tuple(dtypes.name_of(t.dtype) for t in _tensors(_main_output(output)))
                if backward:
                    with recorder.pseudo_module(LOSS):
                        loss_tensor, rec.loss = _loss(output, loss)
                    rec.loss_dtype = dtypes.name_of(loss_tensor.dtype)
        except TraceStopped:
            raise
        except Exception as exc:
            _stopped(rec, exc, recorder.failed_in if recorder.failed_in is not None else ROOT)
            return rec
        if loss_tensor is not None:
            if not loss_tensor.requires_grad:
                raise TraceStopped("--backward: the loss does not require grad (no parameter requires grad, or the output is not floating)")
            recorder.phase = "backward"
            try:
                loss_tensor.backward()
            except TraceStopped:
                raise
            except Exception as exc:
                _stopped(rec, exc, OUTSIDE)
                return rec
            for name, p in model.named_parameters():
                if p.requires_grad:
                    grad = dtypes.name_of(p.grad.dtype) if p.grad is not None else None
                    rec.grads.append(GradRecord(name, dtypes.name_of(p.dtype), grad))
    return rec


def _stopped(rec: Recording, exc: BaseException, module: str) -> None:
    """An exception outside any operation: a dtype check in Python code is a finding; anything else stops the trace."""
    message = first_line(exc)
    if isinstance(exc, (RuntimeError, TypeError, ValueError, AssertionError)) and looks_like_dtype_error(message):
        rec.stopped, rec.stopped_module = message, module
        return
    raise TraceStopped(f"{type(exc).__name__}: {message}", module=module) from exc


def _main_output(output: Any) -> Any:
    """The model's output as users read it: a ModelOutput's first field (logits), else the output itself."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    to_tuple = getattr(output, "to_tuple", None)
    if callable(to_tuple):
        items = [x for x in to_tuple() if isinstance(x, torch.Tensor)]
        loss = getattr(output, "loss", None)
        items = [x for x in items if x is not loss] or items
        return items[0] if items else output
    return output


def _loss(output: Any, kind: str) -> tuple[Any, str]:
    import torch

    own = getattr(output, "loss", None)
    main = _main_output(output)
    if kind == "auto":
        if isinstance(own, torch.Tensor):
            return own, "model"
        if isinstance(main, torch.Tensor) and main.dim() == 0:
            return main, "model"
        kind = "sum"
    first = main if isinstance(main, torch.Tensor) else next(iter(_tensors(main)), None)
    if first is None:
        raise TraceStopped("--backward: the model returned no tensor to make a loss from")
    if kind == "sum":
        return first.sum(), kind
    if kind == "mean":
        return first.mean(), kind
    if kind == "cross-entropy":
        if first.dim() < 2 or not first.is_floating_point():
            raise TraceStopped(f"--loss cross-entropy needs floating logits of at least 2 dims; the output is {tuple(first.shape)}")
        logits = first.reshape(-1, first.shape[-1])
        target = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        return torch.nn.functional.cross_entropy(logits, target), kind
    raise TraceStopped(f"unknown loss '{kind}' (use {', '.join(LOSSES)})")
