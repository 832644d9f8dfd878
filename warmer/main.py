"""`granary warmer`: the scheduler process that will pre-compute predictable prefixes.

For now it starts the APScheduler loop and idles; warm jobs arrive with the warmer issue.
"""

from __future__ import annotations

import logging

from apscheduler.schedulers.blocking import BlockingScheduler

from shared.settings import Settings

log = logging.getLogger(__name__)


def run_warmer(settings: Settings) -> None:
    scheduler = BlockingScheduler()
    log.info("warmer started (schedule %r); no warm specs yet", settings.warmer.schedule)
    try:
        scheduler.start()
    except (KeyboardInterrupt, SystemExit):
        scheduler.shutdown(wait=False)
