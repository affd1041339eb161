"""``MethodPatch``: the one way the plugin wraps a function of vLLM, whichever runner generation
its adapter is written for (``vllm_recycling.patches`` for Model Runner V1,
``vllm_recycling.mrv2`` for Model Runner V2)."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any, Callable

_MARK = "__vllm_recycling_patch__"


class PatchMismatch(RuntimeError):
    """A vLLM function a patch wraps is not what the patch was written for."""


class MethodPatch:
    """Wraps one function of vLLM once: ``wrap(original)`` returns the replacement.

    target: ``"module:Owner.attr"`` (a class's method) or ``"module:function"`` (a module's
    function), imported only when the patch is applied. signature: the target's parameters in
    the vLLM the patch was written for (``parameters``), compared before anything is applied
    (``patches.apply_all``), so that on a vLLM whose target changed the plugin stays inactive
    and refuses method "recycling" naming the target, not at the first step that calls it. name: the class name in snake case, marked on the wrapper so that a second ``apply`` is
    a no-op and a second patch of the same target is refused."""

    target: str
    signature: str
    name: str

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls.__name__).lower()

    @staticmethod
    def wrap(original: Callable) -> Callable:
        raise NotImplementedError

    @staticmethod
    def wanted() -> bool:
        """Whether this process needs the patch (all do, unless a patch says otherwise)."""
        return True

    @classmethod
    def owner_and_attr(cls) -> tuple[Any, str]:
        """The class (or module) holding the target, and the attribute's name."""
        module, _, path = cls.target.partition(":")
        owner: Any = importlib.import_module(module)
        *owners, attr = path.split(".")
        for name in owners:
            owner = getattr(owner, name)
        return owner, attr

    @classmethod
    def problem(cls) -> str | None:
        """Why this patch cannot be applied to this vLLM (its target missing, wrapped by another
        patch, or of other parameters than ``signature``), None when it can (or is applied)."""
        if not cls.wanted():
            return None
        try:
            owner, attr = cls.owner_and_attr()
        except (ImportError, AttributeError) as e:
            return f"patch {cls.name}: {cls.target} is missing ({e})"
        current = owner.__dict__.get(attr)
        if current is None:
            return f"patch {cls.name}: {cls.target} is missing"
        if getattr(current, _MARK, None) == cls.name:
            return None
        if hasattr(current, _MARK):
            return (f"patch {cls.name}: {cls.target} is already wrapped by patch {getattr(current, _MARK)}; "
                    "a target takes one patch")
        found = parameters(current)
        if found != cls.signature:
            return f"patch {cls.name}: {cls.target} takes {found}, the patch was written for {cls.signature}"
        return None

    @classmethod
    def apply(cls) -> bool:
        """Install the wrapper; False if it was already installed or is not wanted here.
        ``PatchMismatch`` (nothing changed) when ``problem`` says it cannot be."""
        problem = cls.problem()
        if problem is not None:
            raise PatchMismatch(problem)
        if not cls.wanted() or cls.is_applied():
            return False
        owner, attr = cls.owner_and_attr()
        current = owner.__dict__[attr]
        replacement = functools.wraps(current)(cls.wrap(current))
        setattr(replacement, _MARK, cls.name)
        setattr(owner, attr, replacement)
        return True

    @classmethod
    def is_applied(cls) -> bool:
        owner, attr = cls.owner_and_attr()
        return getattr(owner.__dict__.get(attr), _MARK, None) == cls.name


def parameters(function: Callable) -> str:
    """A function's parameters as a patch records them: names, kinds and defaults, without
    annotations (which only restate types), e.g. ``(self, logits, spec_decode_metadata)``."""
    signature = inspect.signature(function)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))
