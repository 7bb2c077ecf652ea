"""Typed events and the run ledger (``RUN_DIR/events.jsonl``): ``api`` (the contract), ``ledger`` (the
writer), ``follow`` (the one reader and tailer)."""

from resilient.events.api import SCHEMA_VERSION, Event, EventKind
from resilient.events.follow import ledger_path, read_events
from resilient.events.ledger import Ledger

__all__ = ["SCHEMA_VERSION", "Event", "EventKind", "Ledger", "ledger_path", "read_events"]
