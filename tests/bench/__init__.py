"""Tests of bench/'s shared parts: where a bench measures (bench/site_target.py), against loopback fakes only."""
