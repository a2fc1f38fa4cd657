"""The registry of nsa_compile's custom ops: each op declared once, with its backends.

An op module (window.py, selection.py, ...) writes its validation, its backends' functions and
one `declare(Op(...))` at the bottom; everything else is made here from that declaration:

    torch.ops.nsa.<name>           the forward op (schema as declared), its fake, and its autograd
    torch.ops.nsa.<name>_backward  the backward op and its fake (ops with a backward)
    Op.choose(backend, *choice)    the backend that computes these inputs, with reasons
    Op.backend_names()             'auto' and the declared backends: what OptimizeConfig accepts
    Op.deterministic_auto()        what 'auto' becomes under OptimizeConfig(deterministic=True)

A backend is one `Backend` entry. Its reasons take the op's choice arguments (`Op.choice_args`,
e.g. q, k, v, pos for the window: what the backend choice reads, the same at compile time on
fake tensors and in the op's kernel), its forward and backward the op's arguments without
`backend`, in schema order. `add_backend(op, Backend(...))` registers another one at run time
(tests, experiments); `OptimizeConfig` and `explain` read the registry, so they see it.

Rule of the choice: a named backend must run these inputs (else ValueError with its reason,
which the passes turn into a refusal that `explain` shows); 'auto' takes the first backend of
the declared order that runs them and that auto may take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

__all__ = ["Backend", "Op", "declare", "ops", "get", "add_backend", "remove_backend"]

Reason = Callable[..., "str | None"]


def _runs_everything(*choice) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    """One way of computing an op.

    name:             what the graph and the config call it ('triton', 'reference', ...).
    forward:          (op's arguments without `backend`) -> the op's outputs.
    backward:         (backward op's arguments without `backend`) -> the gradients (None only
                      for an op without a backward).
    cannot_run:       (choice args) -> why it cannot compute these inputs, None where it can. A
                      named backend with a reason is an error.
    auto_reason:      (choice args) -> why 'auto' passes over it, None where auto takes it
                      (default: cannot_run; a Triton backend adds 'off CUDA' here: auto never
                      takes Triton's CPU interpreter).
    in_auto:          False: only ever taken where named ('auto' skips it).
    nondeterministic: why its backward is not bitwise repeatable (atomic adds); None where it is.
                      OptimizeConfig(deterministic=True) refuses such a backend by name.
    """

    name: str
    forward: Callable
    backward: Callable | None = None
    cannot_run: Reason = _runs_everything
    auto_reason: Reason | None = None
    in_auto: bool = True
    nondeterministic: str | None = None

    def why_not_auto(self, *choice) -> str | None:
        if not self.in_auto:
            return "never taken by 'auto' (name it in OptimizeConfig)"
        return (self.auto_reason or self.cannot_run)(*choice)


@dataclass
class Op:
    """One custom op, `torch.ops.nsa.<name>`, declared once.

    name:               the op's name in the `nsa` namespace.
    schema:             its torch schema without the name, e.g. "(Tensor q, ..., str backend='auto',
                        Tensor? pos=None) -> (Tensor, Tensor)"; one argument is `backend`.
    config_field:       the OptimizeConfig field that picks its backend.
    choice_args:        the names of the arguments every reason of its backends takes, in order.
    backends:           'auto's preference order; the last runs everything (reference).
    check:              (op's arguments) -> the chosen backend; ValueError naming the argument for
                        an invalid input (the op module's own validation, then `self.choose`).
    fake:               (op's arguments) -> empty outputs with the real ones' shapes, dtypes and
                        strides (Inductor trusts them).
    backward_schema, check_backward, backward_fake: the same for `<name>_backward` (None: the
                        op has no backward; its outputs get no gradient).
    outputs:            names of the forward's outputs the backward reads (None: not saved).
    non_differentiable: names among `outputs` that get no gradient (lse, gates).
    gradients:          (saved, *grad_outputs) -> {input name: gradient}; `saved` holds the op's
                        arguments and the named outputs as attributes, and `needs_input_grad`
                        ({input name: bool}). Inputs it leaves out get None.
    """

    name: str
    schema: str
    config_field: str
    choice_args: tuple[str, ...]
    backends: tuple[Backend, ...]
    check: Callable[..., str]
    fake: Callable
    backward_schema: str | None = None
    check_backward: Callable[..., str] | None = None
    backward_fake: Callable | None = None
    outputs: tuple[str | None, ...] = ()
    non_differentiable: tuple[str, ...] = ()
    gradients: Callable[..., dict] | None = None
    builtin: tuple[str, ...] = field(default=(), init=False)
    forward_op: object = field(default=None, init=False, repr=False)
    backward_op: object = field(default=None, init=False, repr=False)
    arguments: object = field(default=None, init=False, repr=False)  # the schema's names and defaults

    def bound(self, args: Sequence, kwargs: dict) -> dict:
        """A call's arguments by the schema's names, defaults filled in (a graph's call of the op)."""
        return dict(zip(self.arguments.names, self.arguments.bind(args, kwargs)))

    def backend_names(self) -> tuple[str, ...]:
        """The values its config field takes: 'auto', the backends auto may take in its order, then
        those only taken where named."""
        in_auto = [b.name for b in self.backends if b.in_auto]
        return ("auto", *in_auto, *(b.name for b in self.backends if b.name not in in_auto))

    def backend(self, name: str) -> Backend:
        for b in self.backends:
            if b.name == name:
                return b
        raise ValueError(f"{self.name}: unknown backend {name!r}; valid: {', '.join(self.backend_names())}")

    def choose(self, backend: str, *choice) -> str:
        """The backend that computes these inputs (`choice`: the values of `choice_args`):
        `backend` itself, ValueError with its reason where it cannot run them; for 'auto' the
        first of the order whose `why_not_auto` is None. Only the reasons asked for are computed."""
        if len(choice) != len(self.choice_args):
            raise TypeError(f"{self.name}: the backend choice takes {', '.join(self.choice_args)}; got {len(choice)} "
                            "values")
        if backend != "auto":
            why = self.backend(backend).cannot_run(*choice)
            if why:
                raise ValueError(f"{self.name}: backend {backend!r} cannot run these inputs: {why}")
            return backend
        reasons = []
        for b in self.backends:
            why = b.why_not_auto(*choice)
            if why is None:
                return b.name
            reasons.append(f"{b.name}: {why}")
        raise ValueError(f"{self.name}: no backend runs these inputs ({'; '.join(reasons)})")

    def passed_over(self, chosen: str, *choice) -> list[tuple[str, str]]:
        """(backend, why) for each backend 'auto' tried before `chosen` (what `explain` shows)."""
        passed = []
        for b in self.backends:
            if b.name == chosen:
                break
            if b.in_auto:
                passed.append((b.name, b.why_not_auto(*choice)))
        return passed

    def deterministic_auto(self) -> str | None:
        """What 'auto' becomes under OptimizeConfig(deterministic=True): None where no backend
        auto may take has a non-deterministic backward (auto stays), else the last backend of the
        order with a deterministic one (reference: it runs everything)."""
        if all(b.nondeterministic is None for b in self.backends if b.in_auto):
            return None
        return [b.name for b in self.backends if b.nondeterministic is None][-1]


_OPS: dict[str, Op] = {}


def ops() -> tuple[Op, ...]:
    """Every declared op, in declaration order (importing nsa_compile.ops declares them all)."""
    return tuple(_OPS.values())


def get(name: str) -> Op:
    if name not in _OPS:
        raise ValueError(f"no op named {name!r}; declared: {', '.join(_OPS)}")
    return _OPS[name]


def add_backend(op: str, backend: Backend, first: bool = False) -> Backend:
    """Register another backend of `op`: last in 'auto's order (before the built-in last one,
    which runs everything), or first. Returns it."""
    spec = get(op)
    if backend.name in spec.backend_names():
        raise ValueError(f"{op}: a backend named {backend.name!r} is already registered")
    at = 0 if first else len(spec.backends) - 1
    spec.backends = (*spec.backends[:at], backend, *spec.backends[at:])
    return backend


def remove_backend(op: str, name: str) -> None:
    """Remove a backend registered with `add_backend` (the built-in ones stay)."""
    spec = get(op)
    if name in spec.builtin:
        raise ValueError(f"{op}: {name!r} is a built-in backend (choose another one in OptimizeConfig)")
    spec.backend(name)  # ValueError for a name that is not registered
    spec.backends = tuple(b for b in spec.backends if b.name != name)


# --- the torch.library scaffold ----------------------------------------------------------------


class _Arguments:
    """A schema's argument names and defaults: the full positional argument list of a call
    (the dispatcher drops trailing defaults, and kwargs may name any argument)."""

    def __init__(self, qualified: str):
        schema = getattr(torch.ops.nsa, qualified.split("::")[1]).default._schema
        self.names = [a.name for a in schema.arguments]
        self.defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        self.backend = self.names.index("backend")

    def bind(self, args: Sequence, kwargs: dict) -> list:
        return [*args, *(kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args):])]

    def without_backend(self, values: list) -> list:
        return values[: self.backend] + values[self.backend + 1 :]


def _define(qualified: str, schema: str, check: Callable, kernel_of: Callable, fake: Callable):
    """torch.ops.<qualified>: a kernel that checks, chooses a backend and runs `kernel_of(chosen)`,
    and a fake that checks and returns `fake`'s empty outputs."""

    def kernel(*args, **kwargs):
        values = arguments.bind(args, kwargs)
        return kernel_of(check(*values))(*arguments.without_backend(values))

    def fake_kernel(*args, **kwargs):
        values = arguments.bind(args, kwargs)
        check(*values)
        return fake(*values)

    defined = torch.library.custom_op(qualified, kernel, mutates_args=(), schema=schema)
    defined.register_fake(fake_kernel)
    arguments = _Arguments(qualified)  # the defined schema's names and defaults, which both read
    return defined, arguments


def declare(op: Op) -> Op:
    """Define torch.ops.nsa.<op.name> (and <op.name>_backward, with the autograd formula
    `op.gradients`) from the declaration, and register the op. Returns it."""
    if op.name in _OPS:
        raise ValueError(f"an op named {op.name!r} is already declared")
    op.builtin = tuple(b.name for b in op.backends)
    # op.check is read at each call, so that a wrapper set on the declaration sees every call
    # (parity.py records the block ids the selected-attention op receives this way)
    op.forward_op, arguments = _define(f"nsa::{op.name}", op.schema, lambda *values: op.check(*values),
                                       lambda chosen: op.backend(chosen).forward, op.fake)
    op.arguments = arguments
    if op.backward_schema is not None:
        op.backward_op, _ = _define(f"nsa::{op.name}_backward", op.backward_schema,
                                    lambda *values: op.check_backward(*values),
                                    lambda chosen: op.backend(chosen).backward, op.backward_fake)
        _register_autograd(op, arguments)
    _OPS[op.name] = op
    return op


def _register_autograd(op: Op, arguments: _Arguments) -> None:
    """Save every tensor argument and the named outputs; the backward hands them to
    `op.gradients` by name and returns one gradient per input (None where it gives none)."""
    names = arguments.names

    def setup_context(ctx, inputs, output):
        values = arguments.bind(inputs, {})
        outputs = {n: o for n, o in zip(op.outputs, output) if n is not None}
        tensors = {n: v for n, v in zip(names, values) if isinstance(v, torch.Tensor)} | outputs
        ctx.save_for_backward(*tensors.values())
        ctx.tensor_names = tuple(tensors)
        ctx.others = {n: v for n, v in zip(names, values) if n not in tensors}
        ctx.mark_non_differentiable(*(outputs[n] for n in op.non_differentiable))

    def backward(ctx, *grad_outputs):
        needs = dict(zip(names, ctx.needs_input_grad))
        saved = SimpleNamespace(**ctx.others, **dict(zip(ctx.tensor_names, ctx.saved_tensors)), needs_input_grad=needs)
        grads = op.gradients(saved, *grad_outputs)
        return tuple(grads.get(n) for n in names[: len(ctx.needs_input_grad)])

    op.forward_op.register_autograd(backward, setup_context=setup_context)

