"""The classes `with_zerodp` makes: a Trainer subclass with zerodp's Trainer slotted under it.

Generic over the two classes involved (the HF `Trainer` and `ZeroDPTrainer`,
passed in), so this module imports neither; see [Note: with_zerodp's class
order] in `zerodp.integrations.transformers` for why the order is
`ZeroDP<cls>, cls, ..., ZeroDPTrainer, Trainer`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any


class SubclassFactory:
    """Makes, once per class, `class ZeroDP<cls>(cls, zerodp_base)` for subclasses of `root`.

    `taken_over` names the methods `zerodp_base` defines in place of
    `root`'s: an override of one of them in `cls` that does not call
    `super()` would bypass zerodp, and is refused with a `TypeError`.
    `outermost` names methods the made class wraps around `cls`'s own: the
    made class's `name` calls `self._around_<name>(cls's name, *args, **kwargs)`.
    """

    def __init__(
        self,
        root: type,
        zerodp_base: type,
        taken_over: Sequence[str],
        outermost: Sequence[str] = (),
    ) -> None:
        self.root = root
        self.zerodp_base = zerodp_base
        self.taken_over = tuple(taken_over)
        self.outermost = tuple(outermost)
        self._made: dict[type, type] = {root: zerodp_base}

    def subclass(self, trainer_class: Any) -> Any:
        if not (isinstance(trainer_class, type) and issubclass(trainer_class, self.root)):
            package = self.root.__module__.split(".")[0]
            raise TypeError(
                f"with_zerodp takes a {package}.{self.root.__name__} subclass, "
                f"got {trainer_class!r}"
            )
        if issubclass(trainer_class, self.zerodp_base):
            return trainer_class
        made = self._made.get(trainer_class)
        if made is None:
            self._refuse_bypassing_overrides(trainer_class)
            made = self._make(trainer_class)
            self._made[trainer_class] = made
        return made

    def _make(self, trainer_class: type) -> type:
        base = self.zerodp_base

        class Made(trainer_class, base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, zerodp_config: Any = None, **kwargs: Any) -> None:
                # Taken before trainer_class.__init__, whose signature has no zerodp_config.
                self._take_zerodp_config(
                    zerodp_config, _training_arguments(trainer_class, args, kwargs)
                )
                super().__init__(*args, **kwargs)

        for method in self.outermost:
            setattr(Made, method, _around(Made, method))
        name = f"ZeroDP{trainer_class.__name__}"
        Made.__name__ = Made.__qualname__ = name
        Made.__module__ = self.zerodp_base.__module__
        Made.__doc__ = (
            f"`{trainer_class.__module__}.{trainer_class.__qualname__}` trained by a zerodp "
            "engine (`zerodp.integrations.transformers.with_zerodp`); takes zerodp_config= too."
        )
        return Made

    def _refuse_bypassing_overrides(self, trainer_class: type) -> None:
        for name in self.taken_over:
            for klass in trainer_class.__mro__:
                if klass is self.root:
                    break
                if name not in vars(klass):
                    continue
                method = vars(klass)[name]
                code = getattr(
                    inspect.unwrap(getattr(method, "__func__", method)), "__code__", None
                )
                if code is None or "super" not in code.co_names:
                    raise TypeError(
                        f"with_zerodp({trainer_class.__name__}): {klass.__qualname__}.{name} "
                        "replaces the Trainer's method without calling super(), so it would "
                        f"bypass the zerodp engine; call super().{name}(...) in it, or subclass "
                        "ZeroDPTrainer and write that method for zerodp"
                    )
                break


def _around(made: type, name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(super(made, self), name)
        return getattr(self, f"_around_{name}")(inner, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def _training_arguments(trainer_class: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The `args=` a call of `trainer_class(...)` passes (None when it cannot be told)."""
    try:
        bound = inspect.signature(trainer_class).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None  # the class's own __init__ reports a bad call
    return bound.arguments.get("args")
