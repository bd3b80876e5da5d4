"""Admission and queue policies: which waiting requests start each step."""
