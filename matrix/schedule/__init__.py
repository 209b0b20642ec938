"""Scheduling cells onto the host: which cells run together, and on which GPUs."""

from __future__ import annotations

from matrix.schedule.slots import Demand, Lease, SlotPool, demand_for

__all__ = ["Demand", "Lease", "SlotPool", "demand_for"]
