"""The test suite, one folder per package it tests (tests/gateway/cluster/ holds gateway/cluster's tests); shared
fakes, stacks, tiny models and oracles are the package tests.support (docs/testing.md)."""
