"""Durations, closed-form bounds, the event simulator with max-min sharing, metrics, the memory model. Knows no algorithm."""
