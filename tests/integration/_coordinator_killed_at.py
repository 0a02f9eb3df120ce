"""``geoloco coordinator`` that kills itself with SIGKILL at a chosen moment of a chosen round.

Usage: ``python _coordinator_killed_at.py EVENT ROUND [THEN] coordinator --config ...``: the
moment is the round event ``EVENT`` (a ``geoloco.coordinator.events`` kind) for round ``ROUND``,
or with ``THEN`` the first event of that kind after it. Listeners run synchronously where the
event is emitted, so the process dies exactly there; e.g. ``checkpoint_saved 4`` dies right after
the durable state that follows round 3 is on disk, before round 3's metrics record is written
and before its broadcast is installed; ``checkpoint_saved 4 bytes_sent`` dies in the middle of
round 3's broadcast, once a site has been sent its first bytes.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from geoloco.coordinator.server import CoordinatorServer
from geoloco.scenarios import cli


def main() -> int:
    kind, round_number, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    then = argv.pop(0) if argv and argv[0] != "coordinator" else None
    start = CoordinatorServer.start
    reached = False

    def start_with_kill(self: CoordinatorServer, *args: Any, **kwargs: Any) -> Any:
        def kill_at(event: Any) -> None:
            nonlocal reached
            if reached and event.kind == then:
                os.kill(os.getpid(), signal.SIGKILL)
            if event.kind == kind and event.round == round_number:
                if then is None:
                    os.kill(os.getpid(), signal.SIGKILL)
                reached = True

        self.rounds.events.add_listener(kill_at)
        return start(self, *args, **kwargs)

    CoordinatorServer.start = start_with_kill  # type: ignore[method-assign]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
