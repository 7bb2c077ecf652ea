"""Typed events and the run ledger (one file per writing process under the run directory: ``events.jsonl`` for
the first, ``events.<host>-<pid>.jsonl`` for the others): ``api`` (the contract), ``ledger`` (the writer),
``follow`` (the one reader and tailer, which merges the files into one time line)."""

from resilient.events.api import SCHEMA_VERSION, Event, EventKind
from resilient.events.follow import ledger_path, read_events
from resilient.events.ledger import Ledger

__all__ = ["SCHEMA_VERSION", "Event", "EventKind", "Ledger", "ledger_path", "read_events"]
