"""The ``lean`` benchmark target: the broker's own mitmproxy master with no broker addon.

It forwards with mitmproxy's own upstream side: no authorization, no route, no journal, no
credential. Run like the broker (``python -O``, the same addons and options, the same GC
tuning, the same default event loop), it is the floor the broker's own work stands on, so a run can tell what the broker
adds over mitmproxy apart from what mitmproxy itself costs.

    python -O bench/lean_master.py PORT CONFDIR UPSTREAM_CA
"""

import asyncio
import sys

from mitmproxy import options

from proxy.app import lean_master, loop_factory, tune_gc


async def main(port: int, confdir: str, upstream_ca: str) -> None:
    opts = options.Options(listen_host="127.0.0.1", listen_port=port, confdir=confdir)
    master = lean_master(opts, ssl_verify_upstream_trusted_ca=upstream_ca)
    tune_gc()
    await master.run()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=loop_factory("uvloop", None)) as runner:
        runner.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
