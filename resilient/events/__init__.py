"""Typed events and the run ledger (``RUN_DIR/events.jsonl``)."""

from resilient.events.api import SCHEMA_VERSION, Event, EventKind
from resilient.events.ledger import Ledger, ledger_path, read_events

__all__ = ["SCHEMA_VERSION", "Event", "EventKind", "Ledger", "ledger_path", "read_events"]
