"""Shared test helpers: fakes, process harness, attackers, reference implementations. No tests here."""
