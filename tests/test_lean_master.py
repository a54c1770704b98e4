"""The broker's mitmproxy master walks its addons only for hooks one of them implements."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mitmproxy import hooks, options
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


def test_a_hook_no_addon_implements_is_not_walked_and_one_added_later_is_called(tmp_path: Path):
    async def main() -> None:
        requests = Requests()
        master = lean_master(options.Options(confdir=str(tmp_path)), requests)
        addons = master.addons
        assert isinstance(addons, LeanAddons)
        walked: list[str] = []
        invoke = addons.invoke_addon

        async def spy(addon: Any, event: hooks.Hook) -> None:
            walked.append(event.name)
            await invoke(addon, event)

        addons.invoke_addon = spy  # type: ignore[method-assign]
        flow = tflow.tflow()
        # A flow's lifecycle hook is followed by an `update` hook, which no addon here implements.
        await addons.handle_lifecycle(HttpRequestHook(flow))
        assert requests.seen == [flow]
        assert walked == ["request"] * len(addons.chain), walked

        updates = Updates()
        addons.add(updates)
        walked.clear()
        await addons.handle_lifecycle(HttpRequestHook(flow))
        assert updates.seen == [[flow]] and requests.seen == [flow, flow]
        assert walked == ["request"] * len(addons.chain) + ["update"] * len(addons.chain), walked

        addons.remove(updates)
        walked.clear()
        await addons.handle_lifecycle(HttpRequestHook(flow))
        assert walked == ["request"] * len(addons.chain) and updates.seen == [[flow]], walked

    asyncio.run(main())
