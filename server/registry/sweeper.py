"""Deletes what abandoned uploads left: the staged files and records of upload sessions that
expired (finished, failed or never finished), and staged files that no session owns (a PUT that
landed after its session was swept, a record lost). The app runs it at start and periodically.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from sqlalchemy import delete, or_, select

from server.registry.models import UploadSession, utc_now
from server.registry.service import AdapterRegistry
from server.registry.uploads import UPLOAD_ID

logger = logging.getLogger(__name__)

# A finish claimed before its session expired may still be copying and validating the files:
# its session is swept this long after the expiry, and a crashed finish's files then too.
FINISHING_GRACE = dt.timedelta(hours=1)


def sweep_uploads(registry: AdapterRegistry, now: dt.datetime | None = None) -> list[str]:
    """Deletes expired sessions' staged files and records, and orphaned staged files; returns the
    upload ids swept. Files go first: a sweep cut short leaves orphans, which
    the next sweep finds."""
    now = now or utc_now()
    expired = _expired_upload_ids(registry, now)
    swept = sorted(set(expired) | _orphaned_upload_ids(registry))
    for upload_id in swept:
        registry.blobs.delete_prefix(f"uploads/{upload_id}")
    with registry.sessions() as session, session.begin():
        session.execute(delete(UploadSession).where(UploadSession.id.in_(expired)))
    return swept


async def sweep_uploads_periodically(registry: AdapterRegistry, interval_s: float) -> None:
    """`sweep_uploads` now and every `interval_s` (in a worker thread: database and blob I/O block),
    until cancelled. A failed sweep is logged and tried again at the next interval."""
    while True:
        try:
            swept = await asyncio.to_thread(sweep_uploads, registry)
        except Exception:  # noqa: BLE001 - a database or store outage must not end the sweeping for good
            logger.exception("sweeping abandoned uploads failed; next try in %s s", interval_s)
        else:
            if swept:
                logger.info("deleted the staged files of %d abandoned uploads", len(swept))
        await asyncio.sleep(interval_s)


def _expired_upload_ids(registry: AdapterRegistry, now: dt.datetime) -> list[str]:
    with registry.sessions() as session:
        return list(session.scalars(
            select(UploadSession.id).where(or_(
                (UploadSession.state != "finishing") & (UploadSession.expires_at < now),
                UploadSession.expires_at < now - FINISHING_GRACE,
            ))
        ))


def _orphaned_upload_ids(registry: AdapterRegistry) -> set[str]:
    """Staged upload ids with no session. Listed before the sessions are read: a session always
    exists before its first file, so a new upload is never taken for an orphan."""
    staged = {name for name in registry.blobs.child_names("uploads") if UPLOAD_ID.fullmatch(name)}
    if not staged:
        return set()
    with registry.sessions() as session:
        known = set(session.scalars(select(UploadSession.id).where(UploadSession.id.in_(staged))))
    return staged - known
