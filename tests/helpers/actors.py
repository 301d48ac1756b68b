"""A scripted Ray actor handle for tests that run a caller of actors in-process, with ``ray``
replaced by a stand-in whose ``get`` calls the returned thunk: ``actor.method.remote(*args)`` is
resolved there, recorded, and answers or raises what the test scripted."""

from __future__ import annotations

from types import SimpleNamespace


class ScriptedActor:
    """An actor handle whose methods answer ``pid`` (its process id), ``health`` (True), a scripted
    answer, or their own name, and raise the faults queued for them (``fail``) or set for every call
    (``always``); ``calls`` records each call with its arguments."""

    def __init__(self, name: str, pid: int = 100):
        self.name, self.process, self.calls = name, pid, []
        self.queued: dict[str, list[BaseException]] = {}  # raised by the method's next calls
        self.always: dict[str, BaseException] = {}  # raised by every call of the method
        self.answers: dict[str, object] = {}  # a value, or a function of the call's args

    def fail(self, method: str, *errors: BaseException) -> ScriptedActor:
        self.queued.setdefault(method, []).extend(errors)
        return self

    def __getattr__(self, method: str):
        if method.startswith("_"):  # no actor id: not a Ray handle
            raise AttributeError(method)

        def resolve(*args):
            self.calls.append((method, *args))
            if self.queued.get(method):
                raise self.queued[method].pop(0)
            if method in self.always:
                raise self.always[method]
            if method in self.answers:
                answer = self.answers[method]
                return answer(*args) if callable(answer) else answer
            return {"pid": self.process, "health": True}.get(method, method)

        return SimpleNamespace(remote=lambda *args: lambda: resolve(*args))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]
