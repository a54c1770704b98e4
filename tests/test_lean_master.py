"""The broker's mitmproxy master walks only the addons that implement a hook."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mitmproxy import exceptions, hooks, options
from mitmproxy.proxy.layers.http import HttpRequestHook
from mitmproxy.test import tflow

from proxy.app import LeanAddons, lean_master


class Requests:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def request(self, flow: Any) -> None:
        self.seen.append(flow)


class Updates:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def update(self, flows: list[Any]) -> None:
        self.seen.append(flows)


def test_only_the_addons_implementing_a_hook_are_walked_and_one_added_later_is_called(tmp_path: Path):
    async def main() -> None:
        requests = Requests()
        master = lean_master(options.Options(confdir=str(tmp_path)), requests)
        addons = master.addons
        assert isinstance(addons, LeanAddons)
        walked: list[tuple[str, Any]] = []
        invoke = addons.invoke_addon

        async def spy(addon: Any, event: hooks.Hook) -> None:
            walked.append((event.name, addon))
            await invoke(addon, event)

        def has(addon: Any, name: str) -> bool:  # the addon or one of its children implements it
            return callable(getattr(addon, name, None)) or any(has(child, name) for child in getattr(addon, "addons", []))

        addons.invoke_addon = spy  # type: ignore[method-assign]
        flow = tflow.tflow()
        # A flow's lifecycle hook is followed by an `update` hook, which no addon here implements.
        await addons.handle_lifecycle(HttpRequestHook(flow))
        assert requests.seen == [flow]
        assert [name for name, _ in walked] == ["request"] * sum(has(a, "request") for a in addons.chain), walked
        assert requests in [addon for _, addon in walked] and all(has(addon, name) for name, addon in walked), walked
        assert len(walked) < len(addons.chain), "mitmproxy's own addons were walked for a hook they do not have"

        updates = Updates()
        addons.add(updates)
        walked.clear()
        await addons.handle_lifecycle(HttpRequestHook(flow))
        assert updates.seen == [[flow]] and requests.seen == [flow, flow]
        assert ("update", updates) in walked and all(has(addon, name) for name, addon in walked), walked

        addons.remove(updates)
        walked.clear()
        await addons.handle_lifecycle(HttpRequestHook(flow))
        assert "update" not in [name for name, _ in walked] and updates.seen == [[flow]], walked

    asyncio.run(main())


class First(Requests):
    pass


class Last(Requests):
    pass


class Halts:
    def request(self, flow: Any) -> None:
        raise exceptions.AddonHalt


class Broken:
    def request(self, flow: Any) -> None:
        raise RuntimeError("an addon's bug")


def test_the_walk_keeps_mitmproxys_order_halt_and_error_handling(tmp_path: Path):
    async def main() -> None:
        first, last = First(), Last()
        master = lean_master(options.Options(confdir=str(tmp_path)), first, Broken(), Halts(), last)
        flow = tflow.tflow()
        await master.addons.trigger_event(HttpRequestHook(flow))
        # A failing addon is logged and the walk goes on (safecall); AddonHalt ends it.
        assert first.seen == [flow] and last.seen == []
        mine = {"First", "Broken", "Halts", "Last"}
        assert [n for a in master.addons.implementers("request") if (n := type(a).__name__) in mine] == ["First", "Broken", "Halts", "Last"]

    asyncio.run(main())
