"""The error of the data pipeline that a user can cause."""

from __future__ import annotations


class DataError(ValueError):
    """Bad training data or data settings: the message names the file, column and field."""
