"""Test helpers shared by every package: tiny models, multi-rank workers, contract suites."""
