"""Agents the tests spawn as subprocesses (written with the official ACP SDK)."""
