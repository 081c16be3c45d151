"""Admission control: the limits, and (later) capacity pools and policy. Knows nothing of JSON-RPC."""

from .limits import Limits, check_non_negative_int, check_positive_int

__all__ = ["Limits", "check_non_negative_int", "check_positive_int"]
