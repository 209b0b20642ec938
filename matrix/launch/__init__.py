"""Launching disaggregated pairs: launch plans, arms, the supervisor."""
