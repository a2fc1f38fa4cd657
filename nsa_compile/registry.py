"""The one ordered registry of rewrite passes: the built-ins, then any the user registered."""

from __future__ import annotations

from .rewrite import RewritePass, check_pass

__all__ = ["registered_passes", "pass_names", "register_pass", "unregister_pass"]

_user_passes: list[RewritePass] = []


def registered_passes() -> tuple[RewritePass, ...]:
    from nsa_compile.passes import BUILTIN_PASSES

    return tuple(BUILTIN_PASSES) + tuple(_user_passes)


def pass_names() -> tuple[str, ...]:
    return tuple(p.name for p in registered_passes())


def register_pass(p: RewritePass) -> RewritePass:
    """Append a user's pass to the registry (it runs after the built-ins). Returns it."""
    check_pass(p)
    if p.name in pass_names():
        raise ValueError(f"a pass named {p.name!r} is already registered")
    _user_passes.append(p)
    return p


def unregister_pass(name: str) -> None:
    """Remove a user's pass by name (built-in passes are switched off through OptimizeConfig)."""
    for p in _user_passes:
        if p.name == name:
            _user_passes.remove(p)
            return
    raise ValueError(f"no user pass named {name!r}; user passes: {', '.join(p.name for p in _user_passes) or 'none'}")
