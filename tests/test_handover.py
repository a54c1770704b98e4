"""The delivery watch's decisions, with stand-ins for mitmproxy's flow and the broker's reply.

The watch itself runs against a real mitmproxy in tests/test_broker_e2e.py (a large answer read
slowly, one never read, an HTTP/2 window never opened); these pin what it does when mitmproxy
does not behave as the versions it knows do, where no real run can be made to go."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from proxy import addon
from proxy.contract import CallerDisposition


def _reply(seen: list[Any]) -> Any:
    return SimpleNamespace(invocation_id="act_x", delivered=lambda: seen.append("delivered"),
                           undelivered=lambda how: seen.append(("undelivered", how)))


def _watch(check, flow, monkeypatch, unwritten_for: float = 0.05) -> list[Any]:
    monkeypatch.setattr(addon, "_UNWRITTEN_FOR", unwritten_for)
    seen: list[Any] = []

    async def main() -> None:
        addon._when_handed_over(check, _reply(seen), flow, 0.0)
        for _ in range(200):
            if seen:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    return seen


def test_a_response_mitmproxy_never_writes_is_recorded_as_written_after_the_bound(monkeypatch, caplog):
    flow = SimpleNamespace(live=True, metadata={})
    with caplog.at_level(logging.WARNING, logger="affidavit.addon"):
        seen = _watch(lambda: None, flow, monkeypatch)
    assert seen == ["delivered"]
    assert "was not written" in caplog.text


def test_bytes_still_waiting_keep_the_watch_waiting_past_that_bound(monkeypatch):
    flow = SimpleNamespace(live=False, metadata={})
    looks = iter([None] * 12 + [True])
    seen = _watch(lambda: next(looks), flow, monkeypatch, unwritten_for=0.0)
    assert seen == ["delivered"] and next(looks, "spent") == "spent", "it looked until the bytes had left"


def test_a_check_that_fails_records_the_delivery_as_written(monkeypatch):
    def broken() -> bool:
        raise AttributeError("mitmproxy moved something")

    assert _watch(broken, SimpleNamespace(live=False, metadata={}), monkeypatch) == ["delivered"]


@pytest.mark.parametrize(("left", "how"), [(True, CallerDisposition.CANCELLED), (False, CallerDisposition.DISCONNECTED)])
def test_a_failed_handover_says_how_the_agent_left(monkeypatch, left, how):
    flow = SimpleNamespace(live=False, metadata={addon._LEFT: True} if left else {})
    assert _watch(lambda: False, flow, monkeypatch) == [("undelivered", how)]


def test_a_flag_polled_with_a_timeout_keeps_no_callback_per_poll():
    """A request held for approval polls its caller's flag every 0.25 s for up to the approval
    timeout: each poll that times out leaves nothing behind, and setting the flag still wakes a
    waiter and runs the callbacks registered for good."""
    from proxy.broker import Flag

    async def main() -> list[str]:
        flag, seen = Flag(), []
        flag.add_callback(lambda: seen.append("kept"))
        for _ in range(50):
            assert await flag.wait(0.001) is False
        assert len(flag._callbacks) == 1, "only the callback registered for good"
        waiter = asyncio.ensure_future(flag.wait(5))
        await asyncio.sleep(0)
        flag.set()
        assert await waiter is True and flag._callbacks == []
        assert await flag.wait(0) is True
        return seen

    assert asyncio.run(main()) == ["kept"]
