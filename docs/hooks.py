"""MkDocs hook (mkdocs.yml): the build fails when a public name of the library has no docstring, since the API
reference (api.md) would show it bare."""

from __future__ import annotations

import inspect


def undocumented() -> list[str]:
    """``ddpkit.NAME`` and ``ddpkit.NAME.method`` for every public name in ``ddpkit.__all__`` (and the public
    methods and properties its classes define) that has no docstring of its own."""
    import ddpkit

    missing = []
    for name in ddpkit.__all__:
        value = getattr(ddpkit, name)
        if inspect.ismodule(value) or not (inspect.isclass(value) or callable(value)):
            continue  # constants (STRATEGIES) and modules are described where they are used
        if not (value.__doc__ or "").strip():
            missing.append(f"ddpkit.{name}")
        if inspect.isclass(value):
            for member, attribute in vars(value).items():
                if member.startswith("_") or not (inspect.isfunction(attribute) or isinstance(attribute, property)):
                    continue
                if not (attribute.__doc__ or "").strip():  # a property's is its getter's, or its doc=
                    missing.append(f"ddpkit.{name}.{member}")
    return missing


def on_pre_build(config) -> None:  # noqa: ARG001 (MkDocs' hook signature)
    from mkdocs.exceptions import PluginError

    missing = undocumented()
    if missing:
        raise PluginError(f"{len(missing)} public name(s) without a docstring: {', '.join(missing)}")
