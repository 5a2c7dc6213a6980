"""The scenarios of tests/examples/loss_curves.py, by subject; common.py holds what they share."""
