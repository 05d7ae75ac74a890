"""Shared helpers of the test suite: tiny model checkpoints, fake workers and
executors, server launchers, schedulers driven without a model."""
