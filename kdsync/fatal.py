"""Errors shared by the member's parts (kept apart so that no part imports the member)."""

from __future__ import annotations


class FatalError(Exception):
    """Stops the member: one line for the operator, exit 1."""
