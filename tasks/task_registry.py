"""The registry of tasks by name (seqio style, class-level), and the base of
the mixture registry (``seqcache.tasks.registry``)."""

from __future__ import annotations

import difflib
from typing import ClassVar, Generic, TypeVar

from seqcache.tasks.task import Task

T = TypeVar("T")


def suggest(name: str, names: list[str]) -> str:
    """The close names of ``name`` among ``names`` for a message, or what is registered."""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if close:
        return f"did you mean {', '.join(repr(c) for c in close)}?"
    if not names:
        return "nothing is registered; import the module that defines your tasks (seqcache build --module ...)"
    shown = ", ".join(repr(n) for n in sorted(names)[:10])
    return f"registered: {shown}{' ...' if len(names) > 10 else ''}"


class Registry(Generic[T]):
    """Objects with a ``name``, registered by it at class level (one dict per subclass)."""

    _kind: ClassVar[str]
    _items: ClassVar[dict]

    @classmethod
    def _add(cls, obj: T) -> T:
        if obj.name in cls._items:
            raise ValueError(f"{cls._kind} {obj.name!r} is already registered; remove it first or pick another name")
        cls._items[obj.name] = obj
        return obj

    @classmethod
    def get(cls, name: str) -> T:
        """The registered object of that name.

        Raises:
          KeyError: no such name; the message lists the closest registered names.
        """
        try:
            return cls._items[name]
        except KeyError:
            raise KeyError(f"no {cls._kind} named {name!r}; {suggest(name, list(cls._items))}") from None

    @classmethod
    def names(cls) -> list[str]:
        """Registered names, sorted."""
        return sorted(cls._items)

    @classmethod
    def remove(cls, name: str) -> None:
        """Unregisters ``name`` (KeyError with suggestions if unknown)."""
        cls.get(name)
        del cls._items[name]

    @classmethod
    def reset(cls) -> None:
        """Removes everything (for tests)."""
        cls._items.clear()


class TaskRegistry(Registry[Task]):
    """Global registry of tasks."""

    _kind = "task"
    _items: ClassVar[dict[str, Task]] = {}

    @classmethod
    def add(cls, name_or_task: str | Task, **kwargs) -> Task:
        """Registers a Task, or builds one with ``Task(name, **kwargs)`` and registers it.

        Raises:
          ValueError: the name is already registered (or the Task is invalid).
        """
        if isinstance(name_or_task, Task):
            if kwargs:
                raise TypeError("TaskRegistry.add(task) takes no other arguments")
            return cls._add(name_or_task)
        return cls._add(Task(name_or_task, **kwargs))
